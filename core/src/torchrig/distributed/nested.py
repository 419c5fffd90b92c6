"""Nested structures of tensors — dicts, lists, tuples, namedtuples, HF ``ModelOutput`` — walked,
mapped, moved and measured. One home for what the collectives, the data layer, the Accelerator
and Accelerate's ``utils.operations`` names all need (same semantics as Accelerate's functions).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch


def is_torch_tensor(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor)


def is_namedtuple(data: Any) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_asdict") and hasattr(data, "_fields")


def honor_type(obj: Any, generator: Iterable[Any]) -> Any:
    """``generator``'s items as the type of ``obj`` (list, tuple or namedtuple)."""
    if is_namedtuple(obj):
        return type(obj)(*list(generator))
    return type(obj)(generator)


def recursively_apply(func: Callable[..., Any], data: Any, *args: Any, test_type: Callable[[Any], bool] = is_torch_tensor,
                      error_on_other_type: bool = False, **kwargs: Any) -> Any:
    """``func(leaf, *args, **kwargs)`` for every leaf passing ``test_type`` in a nested
    list/tuple/dict, keeping the containers' types; other leaves pass through (or raise
    ``TypeError`` with ``error_on_other_type``)."""
    if isinstance(data, (tuple, list)):
        return honor_type(data, (recursively_apply(func, item, *args, test_type=test_type,
                                                   error_on_other_type=error_on_other_type, **kwargs) for item in data))
    if isinstance(data, Mapping):
        return type(data)({key: recursively_apply(func, value, *args, test_type=test_type,
                                                  error_on_other_type=error_on_other_type, **kwargs)
                           for key, value in data.items()})
    if test_type(data):
        return func(data, *args, **kwargs)
    if error_on_other_type:
        raise TypeError(f"unsupported type {type(data).__name__} passed to {getattr(func, '__name__', func)}: only "
                        f"nested lists/tuples/dicts of objects accepted by {test_type.__name__} are")
    return data


def send_to_device(data: Any, device: torch.device | str | int, non_blocking: bool = False,
                   skip_keys: str | Sequence[str] | None = None) -> Any:
    """Every tensor of a nested dict/list/tuple/namedtuple moved to ``device``; objects with a
    ``.to`` (HF ``BatchEncoding``) move themselves; ``skip_keys`` of a dict stay where they are."""
    if isinstance(data, torch.Tensor):
        return data.to(device, non_blocking=non_blocking)
    kind = type(data)
    if kind is tuple or kind is list:  # the common batch, once per step: no type dispatch per item
        return kind([v.to(device, non_blocking=non_blocking) if isinstance(v, torch.Tensor)
                     else send_to_device(v, device, non_blocking, skip_keys) for v in data])
    if isinstance(data, (list, tuple)):
        return honor_type(data, (send_to_device(v, device, non_blocking, skip_keys) for v in data))
    to = getattr(data, "to", None)
    if callable(to) and not isinstance(data, (str, bytes)):
        try:
            return to(device, non_blocking=non_blocking)
        except TypeError:
            return to(device)
    if isinstance(data, Mapping):
        skip = (skip_keys,) if isinstance(skip_keys, str) else tuple(skip_keys or ())
        items = {k: v if k in skip else send_to_device(v, device, non_blocking, skip_keys) for k, v in data.items()}
        try:
            return type(data)(items)
        except TypeError:  # a mapping type whose constructor takes something else
            return items
    return data


def _is_half(tensor: Any) -> bool:
    return (isinstance(tensor, torch.Tensor) or hasattr(tensor, "dtype")) and tensor.dtype in (torch.float16,
                                                                                                 torch.bfloat16)


def convert_to_fp32(data: Any) -> Any:
    """fp16/bf16 tensors of a nested structure as fp32 (an HF ``ModelOutput`` keeps its class)."""
    if isinstance(data, Mapping) and hasattr(data, "__setitem__") and type(data) is not dict:
        for key in list(data.keys()):  # ModelOutput: its constructor cannot rebuild it from a dict
            data[key] = recursively_apply(torch.Tensor.float, data[key], test_type=_is_half)
        return data
    return recursively_apply(torch.Tensor.float, data, test_type=_is_half)


def convert_outputs_to_fp32(model_forward: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a forward so that its half-precision outputs come back in fp32."""

    @functools.wraps(model_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return convert_to_fp32(model_forward(*args, **kwargs))

    return forward


@attrs.frozen
class TensorInformation:
    """Shape and dtype of a tensor (to rebuild it elsewhere with :func:`initialize_tensors`)."""

    shape: torch.Size
    dtype: torch.dtype


def is_tensor_information(data: Any) -> bool:
    return isinstance(data, TensorInformation)


def get_data_structure(data: Any) -> Any:
    """The nested structure with each tensor replaced by its :class:`TensorInformation`."""
    return recursively_apply(lambda t: TensorInformation(shape=t.shape, dtype=t.dtype), data)


def get_shape(data: Any) -> Any:
    return recursively_apply(lambda t: list(t.shape), data)


def initialize_tensors(data_structure: Any) -> Any:
    """Empty tensors for a structure of :class:`TensorInformation`."""
    return recursively_apply(lambda info: torch.empty(*info.shape, dtype=info.dtype), data_structure,
                             test_type=is_tensor_information)


def find_batch_size(data: Any) -> int:
    """The first dimension of the first tensor found (raises on empty or tensor-less data)."""
    if isinstance(data, (tuple, list, Mapping)) and len(data) == 0:
        raise ValueError(f"cannot find the batch size of an empty {type(data).__name__}")
    if isinstance(data, (tuple, list)):
        return find_batch_size(data[0])
    if isinstance(data, Mapping):
        return find_batch_size(next(iter(data.values())))
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"can only find the batch size of tensors, not of a {type(data).__name__}")
    return int(data.shape[0])


def ignorant_find_batch_size(data: Any) -> int | None:
    try:
        return find_batch_size(data)
    except (ValueError, TypeError):
        return None


def listify(data: Any) -> Any:
    """Tensors as (nested) Python lists of numbers (bf16 through fp32, which NumPy lacks)."""

    def to_list(tensor: torch.Tensor) -> Any:
        tensor = tensor.detach().cpu()
        return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).tolist()

    return recursively_apply(to_list, data)


def slice_tensors(data: Any, tensor_slice: Any, process_index: int | None = None,
                  num_processes: int | None = None) -> Any:
    return recursively_apply(lambda t: t[tensor_slice], data)


def concatenate(data: Sequence[Any], dim: int = 0) -> Any:
    """Concatenate a list of identically nested structures of tensors, leaf by leaf."""
    first = data[0]
    if isinstance(first, (tuple, list)):
        return honor_type(first, (concatenate([d[i] for d in data], dim=dim) for i in range(len(first))))
    if isinstance(first, Mapping):
        return type(first)({k: concatenate([d[k] for d in data], dim=dim) for k in first})
    if isinstance(first, torch.Tensor):
        return torch.cat(list(data), dim=dim)
    if len(data) == 1:
        return first
    raise TypeError(f"can only concatenate tensors, not {type(first).__name__}")


def find_device(data: Any) -> torch.device | None:
    """The device of the first tensor found, or None."""
    if isinstance(data, Mapping):
        data = list(data.values())
    if isinstance(data, (tuple, list)):
        for item in data:
            device = find_device(item)
            if device is not None:
                return device
        return None
    return data.device if isinstance(data, torch.Tensor) else None


def pad_input_tensors(data: Any, batch_size: int, num_processes: int, dim: int = 0) -> Any:
    """Pad the first dimension of every tensor (zeros) so ``num_processes`` ranks get equal shares
    (Accelerate's rule, kept exactly so padded shapes match)."""

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        per, last = batch_size // num_processes, batch_size % num_processes
        to_pad = num_processes - batch_size if per == 0 else num_processes - per
        if last > to_pad & to_pad < 1:  # Accelerate's expression, precedence included
            to_pad = last - to_pad
        shape = list(tensor.shape)
        shape[0] = batch_size + to_pad
        padded = tensor.new_zeros(tuple(shape))
        padded[tuple(slice(0, tensor.shape[dim]) if i == dim else slice(None) for i in range(len(shape)))] = tensor
        return padded

    return recursively_apply(pad, data, error_on_other_type=True)


class CannotPadNestedTensorWarning(UserWarning):
    """``pad_across_processes`` met a nested tensor: it is left as it is."""


def pad_to(tensor: torch.Tensor, size: int, dim: int, pad_index: Any, pad_first: bool) -> torch.Tensor:
    """``tensor`` padded along ``dim`` to ``size`` with ``pad_index`` (before, with ``pad_first``)."""
    if getattr(tensor, "is_nested", False):
        warnings.warn("cannot pad a nested tensor without more information; it is left unpadded",
                      CannotPadNestedTensorWarning, stacklevel=3)
        return tensor
    if size == tensor.shape[dim]:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = size - tensor.shape[dim]
    filler = tensor.new_full(shape, pad_index)
    return torch.cat([filler, tensor] if pad_first else [tensor, filler], dim=dim)


def merge_dicts(source: Mapping[str, Any], destination: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``source`` into ``destination`` (nested dicts merged, other values replaced)."""
    for key, value in source.items():
        if isinstance(value, Mapping):
            merge_dicts(value, destination.setdefault(key, {}))
        else:
            destination[key] = value
    return destination


__all__ = [
    "CannotPadNestedTensorWarning", "TensorInformation", "concatenate", "convert_outputs_to_fp32", "convert_to_fp32",
    "find_batch_size", "find_device", "get_data_structure", "get_shape", "honor_type", "ignorant_find_batch_size",
    "initialize_tensors", "is_namedtuple", "is_tensor_information", "is_torch_tensor", "listify", "merge_dicts",
    "pad_input_tensors", "pad_to", "recursively_apply", "send_to_device", "slice_tensors",
]
