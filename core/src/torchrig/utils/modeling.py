"""Module and tensor helpers with Accelerate's names: sizes, tied weights, moving or materialising
one tensor of a module, loading a checkpoint into a (possibly meta-initialised) model, unwrapping.

What needs a device map (dispatching one model across devices, offloading) is not here: torchrig
trains, and shards large models with its strategies (docs/accelerate.md lists those refusals).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import json
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from torchrig.checkpoint.export import parse_size
from torchrig.compat.enums import CustomDtype, DistributedType
from torchrig.compat.resolve import module_attributes
from torchrig.distributed.process import AcceleratorState
from torchrig.training.compile import has_compiled_regions, is_compiled_module
from torchrig.utils.imports import is_peft_available

_log = logging.getLogger(__name__)

_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                      "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))


def dtype_byte_size(dtype: torch.dtype | CustomDtype) -> float:
    """Bytes per element (a fraction for bool, int4 and int2)."""
    if dtype == torch.bool:
        return 1 / 8
    if dtype == CustomDtype.INT2:
        return 1 / 4
    if dtype == CustomDtype.INT4:
        return 1 / 2
    if dtype == CustomDtype.FP8 or dtype in _FP8_DTYPES:
        return 1
    bits = re.search(r"[^\d](\d+)$", str(dtype))
    if bits is None:
        raise ValueError(f"not a valid dtype: {dtype}")
    return int(bits.group(1)) // 8


def convert_file_size_to_int(size: int | str) -> int:
    """``"5GB"`` (10**9), ``"5GiB"`` (2**30), ``"500MB"``, an int of bytes -> bytes; a lower-case
    ``b`` counts bits (``"5Gb"`` = 5*10**9/8), as in Accelerate."""
    if isinstance(size, str) and re.fullmatch(r"\s*\d+(\.\d+)?\s*[KMGT]b\s*", size):
        return parse_size(size[:-1] + "B") // 8
    try:
        return parse_size(size)
    except ValueError:
        raise ValueError(f"size {size!r} is not in a valid format: use an integer of bytes or a string with a unit "
                         "such as '5GB' or '500MiB'") from None


def id_tensor_storage(tensor: torch.Tensor) -> tuple[torch.device, int, int]:
    """``(device, storage address, storage bytes)``: equal for tensors sharing memory."""
    try:
        storage = tensor.untyped_storage()
        return tensor.device, storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):  # meta tensors have no storage address
        return tensor.device, 0, tensor.nelement() * tensor.element_size()


def named_module_tensors(module: torch.nn.Module, include_buffers: bool = True, recurse: bool = False,
                         remove_non_persistent: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's parameters, then (with ``include_buffers``) its buffers — without the
    non-persistent ones if asked."""
    yield from module.named_parameters(recurse=recurse)
    if include_buffers:
        skipped = _non_persistent_buffers(module, recurse) if remove_non_persistent else set()
        for name, buffer in module.named_buffers(recurse=recurse):
            if name not in skipped:
                yield name, buffer


def _non_persistent_buffers(module: torch.nn.Module, recurse: bool) -> set[str]:
    named = module.named_modules() if recurse else [("", module)]
    return {f"{prefix}.{name}" if prefix else name
            for prefix, sub in named for name in sub._non_persistent_buffers_set}


def compute_module_sizes(model: torch.nn.Module, dtype: str | torch.dtype | None = None,
                         special_dtypes: Mapping[str, str | torch.dtype] | None = None,
                         buffers_only: bool = False) -> dict[str, int]:
    """Bytes of every module (``""`` is the whole model), optionally as if stored in ``dtype``
    (integer and bool tensors keep their own size)."""
    as_dtype = _dtype(dtype) if dtype is not None else None
    special = {name: _dtype(value) for name, value in (special_dtypes or {}).items()}
    sizes: dict[str, int] = collections.defaultdict(int)
    tensors = model.named_buffers(recurse=True) if buffers_only else named_module_tensors(model, recurse=True)
    for name, tensor in tensors:
        if name in special:
            size = tensor.numel() * dtype_byte_size(special[name])
        elif as_dtype is None or str(tensor.dtype).startswith(("torch.uint", "torch.int", "torch.bool")):
            size = tensor.numel() * dtype_byte_size(tensor.dtype)
        else:
            size = tensor.numel() * min(dtype_byte_size(as_dtype), dtype_byte_size(tensor.dtype))
        parts = name.split(".")
        for depth in range(len(parts) + 1):
            sizes[".".join(parts[:depth])] += size
    return sizes


def _dtype(value: str | torch.dtype) -> torch.dtype:
    return getattr(torch, value.replace("torch.", "")) if isinstance(value, str) else value


def get_max_layer_size(modules: Sequence[tuple[str, Any]], module_sizes: Mapping[str, int],
                       no_split_module_classes: Sequence[str]) -> tuple[int, list[str]]:
    """The largest "layer" (a module without children, or one of ``no_split_module_classes``)
    among ``modules``, and the names of the layers of that size."""
    largest, names = 0, []
    pending = list(modules)
    while pending:
        name, module = pending.pop(0)
        children = list(module.named_children()) if isinstance(module, torch.nn.Module) else []
        if not children or type(module).__name__ in no_split_module_classes:
            size = module_sizes[name]
            if size > largest:
                largest, names = size, [name]
            elif size == largest:
                names.append(name)
        else:
            pending = [(f"{name}.{child}", sub) for child, sub in children] + pending
    return largest, names


def calculate_maximum_sizes(model: torch.nn.Module) -> tuple[int, tuple[int, list[str]]]:
    """``(total bytes, (largest layer's bytes, its names))``."""
    sizes = compute_module_sizes(model)
    top = (list(model.named_parameters(recurse=False)) + list(model.named_children())
           + list(model.named_buffers(recurse=False)))
    return sizes[""], get_max_layer_size(top, sizes, getattr(model, "_no_split_modules", None) or [])


def find_tied_parameters(model: torch.nn.Module, **kwargs: Any) -> list[list[str]]:
    """Groups of parameter names that are one and the same parameter (sorted)."""
    by_identity: dict[int, list[str]] = collections.defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        by_identity[id(param)].append(name)
    return [sorted(names) for names in by_identity.values() if len(names) > 1]


def retie_parameters(model: torch.nn.Module, tied_params: Sequence[Sequence[str]]) -> None:
    """Make every name of each group refer to its first parameter that is not on the meta device."""
    for group in tied_params:
        source = next((recursive_getattr(model, name) for name in group
                       if recursive_getattr(model, name).device != torch.device("meta")), None)
        if source is None:
            continue
        for name in group:
            owner, _, attribute = name.rpartition(".")
            setattr(recursive_getattr(model, owner) if owner else model, attribute, source)


def check_tied_parameters_in_config(model: torch.nn.Module) -> bool:
    """Whether a transformers model's configuration ties weights (word embeddings, encoder and
    decoder, or a module's own ``_tie_weights``)."""
    if "PreTrainedModel" not in [cls.__name__ for cls in inspect.getmro(type(model))]:
        return False
    config = getattr(model, "config", None)
    decoder = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    tied_embeddings = bool(decoder is not None and getattr(decoder, "tie_word_embeddings", False)
                           and model.get_output_embeddings())
    tied_encoder_decoder = bool(getattr(config, "is_encoder_decoder", False)
                                and getattr(config, "tie_encoder_decoder", False))
    return tied_embeddings or tied_encoder_decoder or any(hasattr(m, "_tie_weights") for m in model.modules())


def set_module_tensor_to_device(module: torch.nn.Module, tensor_name: str, device: int | str | torch.device,
                                value: torch.Tensor | None = None, dtype: str | torch.dtype | None = None,
                                fp16_statistics: Any = None, tied_params_map: dict[int, dict[Any, Any]] | None = None,
                                non_blocking: bool = False, clear_cache: bool = True) -> None:
    """Move the parameter or buffer ``tensor_name`` (dotted) of ``module`` to ``device`` — or
    replace it with ``value`` there (same shape; cast to its dtype, or to ``dtype``) — keeping
    its parameter class and ``requires_grad``. This is how a meta-initialised model is filled."""
    if fp16_statistics is not None:
        raise ValueError("set_module_tensor_to_device(fp16_statistics=...) is for bitsandbytes 8-bit weights, which "
                         "torchrig does not load")
    owner_name, _, tensor_name = tensor_name.rpartition(".")
    owner = recursive_getattr(module, owner_name) if owner_name else module
    if tensor_name not in owner._parameters and tensor_name not in owner._buffers:
        raise ValueError(f"{type(owner).__name__} has no parameter or buffer named {tensor_name!r}")
    is_buffer = tensor_name in owner._buffers
    old = getattr(owner, tensor_name)
    for key in ((value.data_ptr(),) if value is not None else ()) + (old.data_ptr(),):
        shared = (tied_params_map or {}).get(key, {})
        if device in shared:  # a tied weight already placed there: share it
            owner._parameters[tensor_name] = shared[device]
            return
    if old.device == torch.device("meta") and str(device) != "meta" and value is None:
        raise ValueError(f"{tensor_name} is on the meta device: a value is needed to put it on {device}")
    target_dtype = _dtype(dtype) if dtype is not None else None
    with torch.no_grad():
        if value is None:
            new = old.to(device, non_blocking=non_blocking)
            if target_dtype is not None and str(device) == "meta" and old.is_floating_point():
                new = new.to(target_dtype)
        else:
            value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
            if old.shape != value.shape:
                raise ValueError(f"cannot set a tensor of shape {tuple(value.shape)} into {tensor_name!r}, whose shape "
                                 f"is {tuple(old.shape)}")
            if target_dtype is None:
                value = value.to(old.dtype)
            elif not str(value.dtype).startswith(("torch.uint", "torch.int", "torch.bool")):
                value = value.to(target_dtype)
            new = value.to(device, non_blocking=non_blocking)
        if is_buffer:
            owner._buffers[tensor_name] = new
        else:
            owner._parameters[tensor_name] = type(owner._parameters[tensor_name])(new, requires_grad=old.requires_grad)
    if clear_cache and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def align_module_device(module: torch.nn.Module, execution_device: torch.device | str | None = None) -> Iterator[None]:
    """Within the block, the module's own parameters are on ``execution_device`` (then moved back)."""
    if execution_device is None:
        yield
        return
    devices = {name: param.device for name, param in module.named_parameters(recurse=False)}
    try:
        for name in devices:
            set_module_tensor_to_device(module, name, execution_device)
        yield
    finally:
        for name, device in devices.items():
            set_module_tensor_to_device(module, name, device)


def _refuse_device_map(function: str, **options: Any) -> None:
    given = [name for name, value in options.items() if value not in (None, False)]
    if given:
        raise ValueError(f"{function}({', '.join(f'{name}=...' for name in given)}): device maps and offloading are "
                         "big-model inference, which torchrig does not do; load the weights whole and shard them with "
                         "the fsdp or deepspeed strategy (docs/accelerate.md)")


def load_state_dict(checkpoint_file: str | os.PathLike[str], device_map: Any = None) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file, or of a torch file (read with ``weights_only``)."""
    _refuse_device_map("load_state_dict", device_map=device_map)
    path = os.fspath(checkpoint_file)
    if path.endswith(".safetensors"):
        from safetensors import safe_open
        from safetensors.torch import load_file

        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata() or {"format": "pt"}
        if metadata.get("format", "pt") != "pt":
            raise ValueError(f"{path} was saved with the {metadata['format']!r} format; torchrig reads 'pt' files")
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _checkpoint_files(checkpoint: str) -> list[str]:
    """The weight files of a file, an index file, or a directory holding one of either."""
    if os.path.isfile(checkpoint):
        if checkpoint.endswith(".index.json"):
            with open(checkpoint) as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
            return [os.path.join(os.path.dirname(checkpoint), shard) for shard in shards]
        return [checkpoint]
    if not os.path.isdir(checkpoint):
        raise ValueError(f"{checkpoint}: no such checkpoint file or directory")
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.isfile(os.path.join(checkpoint, name)):
            return _checkpoint_files(os.path.join(checkpoint, name))
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.isfile(os.path.join(checkpoint, name)):
            return [os.path.join(checkpoint, name)]
    listing = ", ".join(sorted(os.listdir(checkpoint))[:10]) or "(empty)"
    raise ValueError(f"{checkpoint} holds no model.safetensors, pytorch_model.bin or index file; it has: {listing}")


def load_checkpoint_in_model(model: torch.nn.Module, checkpoint: str | os.PathLike[str], device_map: Any = None,
                             offload_folder: Any = None, dtype: str | torch.dtype | None = None,
                             offload_state_dict: bool = False, offload_buffers: bool = False,
                             keep_in_fp32_modules: Sequence[str] | None = None, offload_8bit_bnb: bool = False,
                             strict: bool = False, full_state_dict: bool = True,
                             broadcast_from_rank0: bool = False) -> None:
    """Load the weights of ``checkpoint`` — a weights file, a sharded index
    (``*.index.json``, as ``save_model`` writes) or a directory holding either — into ``model``,
    materialising meta-device tensors on the CPU; floating weights are cast to ``dtype`` (except
    in ``keep_in_fp32_modules``). ``strict`` raises on missing or unexpected names."""
    _refuse_device_map("load_checkpoint_in_model", device_map=device_map, offload_folder=offload_folder,
                       offload_state_dict=offload_state_dict, offload_buffers=offload_buffers,
                       offload_8bit_bnb=offload_8bit_bnb, broadcast_from_rank0=broadcast_from_rank0)
    if not full_state_dict:
        raise ValueError("load_checkpoint_in_model(full_state_dict=False): torchrig loads full state dicts here; a "
                         "sharded checkpoint of a run loads with accelerator.load_state()")
    expected = {name for name, _ in named_module_tensors(model, recurse=True, remove_non_persistent=True)}
    keep_fp32 = tuple(keep_in_fp32_modules or ())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in _checkpoint_files(os.fspath(checkpoint)):
        for name, tensor in load_state_dict(path).items():
            if name not in expected:
                unexpected.append(name)
                continue
            target = dtype
            if keep_fp32 and any(part in keep_fp32 for part in name.split(".")):
                target = torch.float32
            old = recursive_getattr(model, name)
            device = "cpu" if old.device == torch.device("meta") else old.device
            set_module_tensor_to_device(model, name, device, value=tensor,
                                        dtype=target if tensor.is_floating_point() else None)
            loaded.add(name)
    missing = sorted(expected - loaded)
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_checkpoint_in_model({checkpoint}): missing {missing or 'none'}; unexpected "
                           f"{sorted(unexpected) or 'none'}")
    if missing or unexpected:
        _log.warning("load_checkpoint_in_model(%s): %d missing weights %s, %d unexpected %s", checkpoint,
                     len(missing), missing[:5], len(unexpected), sorted(unexpected)[:5])
    retie_parameters(model, find_tied_parameters(model))


def clean_state_dict_for_safetensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Drop the second and later names of tensors that share memory (safetensors refuses shared
    storage), with a warning naming them; returns the same dict."""
    by_storage: dict[Any, list[str]] = collections.defaultdict(list)
    for name, tensor in state_dict.items():
        if isinstance(tensor, torch.Tensor):
            by_storage[id_tensor_storage(tensor)].append(name)
    dropped = [name for names in by_storage.values() for name in names[1:]]
    for name in dropped:
        del state_dict[name]
    if dropped:
        _log.warning("removed shared tensors %s before saving with safetensors; tie the weights again after loading",
                     dropped)
    return state_dict


def recursive_getattr(obj: Any, attr: str) -> Any:
    """``getattr`` along a dotted path (``"encoder.layer.0"``)."""
    return functools.reduce(getattr, [obj, *attr.split(".")]) if attr else obj


def get_module_children_bottom_up(model: torch.nn.Module, return_fqns: bool = False) -> list[Any]:
    """Every submodule, children before parents, the model last (``(name, module)`` with ``return_fqns``)."""
    stack: list[tuple[str, torch.nn.Module]] = [("", model)]
    ordered = []
    while stack:
        name, current = stack.pop()
        for child_name, child in current.named_children():
            stack.append((f"{name}.{child_name}" if name else child_name, child))
        ordered.append((name, current) if return_fqns else current)
    return ordered[::-1]


def model_has_dtensor(model: torch.nn.Module) -> bool:
    """Whether some parameter is a ``DTensor`` (sharded by FSDP2 or tensor parallelism)."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    if dtensor_module is None:  # never imported, so no DTensor exists (importing it costs ~0.6 s)
        return False
    return any(isinstance(param, dtensor_module.DTensor) for param in model.parameters())


def get_model_tp_size(model: torch.nn.Module) -> int | None:
    """The tensor-parallel degree a transformers model was sharded with (``None`` when it was not):
    transformers 4 records ``model.tp_size``, transformers 5 its ``config.distributed_config.tp_size``."""
    tp_size = getattr(model, "tp_size", None)
    if tp_size is not None:
        return tp_size
    distributed_config = getattr(getattr(model, "config", None), "distributed_config", None)
    if isinstance(distributed_config, dict):
        return distributed_config.get("tp_size")
    return getattr(distributed_config, "tp_size", None)


def _is_wrapper(model: torch.nn.Module) -> bool:
    """A distributed container around one user module (DDP, DataParallel, a DeepSpeed engine...):
    its one child is ``module``. Decided from the shape, never from which strategy made it."""
    children = dict(model.named_children())
    return set(children) == {"module"}


def extract_model_from_parallel(model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                                recursive: bool = False) -> Any:
    """The user's module inside distributed containers (DDP, DataParallel, a DeepSpeed engine:
    any wrapper whose only child is ``.module``) and, unless ``keep_torch_compile``, inside a
    ``torch.compile`` wrapper; without ``keep_fp32_wrapper`` the forward torchrig wrapped for
    mixed precision is restored. ``recursive`` unwraps such containers at every depth."""
    compiled = model if is_compiled_module(model) else None
    if compiled is not None:
        model = model._orig_mod
    elif has_compiled_regions(model) and "_orig_mod" in model.__dict__:
        compiled, model = model, model.__dict__["_orig_mod"]
    while isinstance(model, torch.nn.Module) and _is_wrapper(model):
        model = model.module
    if recursive:
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                inner = child
                while _is_wrapper(inner):
                    inner = inner.module
                if inner is not child:
                    setattr(module, name, inner)
    if not keep_fp32_wrapper and hasattr(model, "_torchrig_original_forward"):
        model.forward = model._torchrig_original_forward
        del model._torchrig_original_forward
    if keep_torch_compile and compiled is not None:
        compiled._orig_mod = model
        return compiled
    return model


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` (inside any distributed container) is a ``peft.PeftModel``."""
    if not is_peft_available():
        return False
    from peft import PeftModel

    return isinstance(extract_model_from_parallel(model), PeftModel)


def get_mixed_precision_context_manager(native_amp: bool = False, autocast_kwargs: Any = None) -> Any:
    """``torch.autocast`` for the running configuration's declared precision and its device
    (fp16 → float16, bf16/fp8 → bfloat16, else autocast's default), or a no-op context when
    ``native_amp`` is False. For computation outside the model: a prepared model applies its
    precision itself (``accelerator.autocast()`` is the same for the run's own plugin)."""
    if not native_amp:
        return contextlib.nullcontext()
    state = AcceleratorState()
    kwargs = {} if autocast_kwargs is None else autocast_kwargs.to_kwargs()
    device_type = state.device.type
    if state.mixed_precision == "fp16":
        return torch.autocast(device_type=device_type, dtype=torch.float16, **kwargs)
    if state.mixed_precision in ("bf16", "fp8"):
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16, **kwargs)
    return torch.autocast(device_type=device_type, **kwargs)


def get_grad_scaler(distributed_type: DistributedType | None = None, **kwargs: Any) -> Any:
    """A loss scaler for fp16: FSDP's ``ShardedGradScaler`` for ``DistributedType.FSDP``, else
    ``torch.amp.GradScaler`` for CUDA (MPS on Macs, where available)."""
    if distributed_type == DistributedType.FSDP:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(**kwargs)
    if not torch.cuda.is_available() and torch.backends.mps.is_available():
        return torch.amp.GradScaler("mps", **kwargs)
    return torch.amp.GradScaler("cuda", **kwargs)


__all__ = [
    "align_module_device", "calculate_maximum_sizes", "check_tied_parameters_in_config",
    "clean_state_dict_for_safetensors", "compute_module_sizes", "convert_file_size_to_int", "dtype_byte_size",
    "extract_model_from_parallel", "find_tied_parameters", "get_grad_scaler", "get_max_layer_size",
    "get_mixed_precision_context_manager", "get_model_tp_size", "get_module_children_bottom_up", "id_tensor_storage",
    "is_peft_model",
    "load_checkpoint_in_model", "load_state_dict", "model_has_dtensor", "named_module_tensors", "recursive_getattr",
    "retie_parameters", "set_module_tensor_to_device",
]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
