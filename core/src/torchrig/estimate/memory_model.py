"""The model side of a memory estimate: build a model on the meta device and measure what it holds.

``MODEL`` for ``torchrig estimate-memory`` is one of

* a Python factory ``package.module:function`` returning a ``torch.nn.Module`` (called under
  ``torch.device("meta")``, the current directory importable);
* a local ``config.json`` file, or a directory holding one (a transformers config);
* a transformers model name whose config is in the local cache (looked up offline only).

Activations are counted by one forward on the meta device under
:class:`torch.autograd.graph.saved_tensors_hooks`: the bytes autograd keeps for backward,
parameters (and views of them) excluded, each storage once — the same counter that the tests run
on a real CPU batch (:class:`SavedTensorCounter`), so estimate and measurement count alike.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any, Self

import torch

from torchrig.errors import TorchrigError
from torchrig.estimate.memory import ModelFootprint, ParameterInfo

_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class ModelSpecError(TorchrigError):
    """MODEL names nothing that can be built: one message, exit 2."""


class SavedTensorCounter:
    """Bytes autograd saves for backward while active (a context manager).

    Each storage is counted once (by address on real devices, by the owning tensor on the meta
    device, where every address is 0); tensors that are parameters, or views of them, are not
    activations and are skipped. ``bytes`` holds the total afterwards.
    """

    def __init__(self, parameters: Any = ()) -> None:
        self._parameters = {id(p) for p in parameters}
        self._seen: dict[Any, int] = {}
        self._keep: list[torch.Tensor] = []  # ids stay unique while counting
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) in self._parameters or id(tensor) in self._parameters:
            return tensor
        storage = base.untyped_storage()
        key: Any = id(base) if base.device.type == "meta" else storage.data_ptr()
        if key not in self._seen:
            self._seen[key] = storage.nbytes()
            self._keep.append(base)
        return tensor

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self._keep.clear()


_NATIVE_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_NAMES = ("attn_mask", "dropout_p", "is_causal", "scale")


def _fused_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    options = {**dict(zip(_SDPA_NAMES, args)), **kwargs}
    if query.device.type != "meta" or options.get("enable_gqa"):
        return _NATIVE_SDPA(query, key, value, *args, **kwargs)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, options.get("dropout_p", 0.0), options.get("is_causal", False),
        attn_mask=options.get("attn_mask"), scale=options.get("scale"))[0]


@contextlib.contextmanager
def fused_attention_on_meta() -> Iterator[None]:
    """``torch.nn.functional.scaled_dot_product_attention`` on meta tensors as the fused kernel real
    devices run, while active.

    On the meta device torch picks the math fallback, which saves the ``(batch, heads, seq, seq)``
    attention matrix for backward; CPU (flash for CPU) and GPU (flash, memory-efficient) kernels
    save only query, key, value, output and the log-sum-exp. Counting the fallback would
    over-estimate attention activations by a quadratic term real runs never hold. The function is
    looked up at call time by ``nn.MultiheadAttention`` and transformers, so replacing the module
    attribute reaches them (a torch-function mode would not: it is off inside
    ``multi_head_attention_forward``).
    """
    functional = torch.nn.functional
    functional.scaled_dot_product_attention = _fused_sdpa
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = _NATIVE_SDPA


# -- building the model --------------------------------------------------------------------


def resolve_model(spec: str) -> tuple[str, Callable[[], torch.nn.Module]]:
    """``(display name, build)`` for MODEL; ``build()`` constructs it (call it on the meta device)."""
    if os.path.exists(spec):
        return spec, _from_config_path(spec)
    if _FACTORY.match(spec):
        return spec, _from_factory(spec)
    return spec, _from_transformers(_cached_config(spec), spec)


def build_on_meta(build: Callable[[], torch.nn.Module], spec: str) -> torch.nn.Module:
    with torch.device("meta"):
        model = build()
    if not isinstance(model, torch.nn.Module):
        raise ModelSpecError(f"MODEL {spec!r} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def _from_factory(spec: str) -> Callable[[], torch.nn.Module]:
    module_name, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelSpecError(f"MODEL {spec!r}: cannot import module {module_name!r} ({exc})") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ModelSpecError(f"MODEL {spec!r}: module {module_name!r} has no callable {attribute!r}")
    return factory


def _from_config_path(path: str) -> Callable[[], torch.nn.Module]:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ModelSpecError(f"MODEL {path!r} is a directory without a config.json")
    try:
        with open(file, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelSpecError(f"MODEL {file!r} is not a readable JSON config ({exc})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ModelSpecError(f"MODEL {file!r} has no 'model_type': not a transformers config.json")
    transformers = _transformers(file)
    try:
        config = transformers.AutoConfig.for_model(**data)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelSpecError(f"MODEL {file!r}: transformers cannot read it ({exc})") from None
    return _from_transformers(config, file)


def _cached_config(name: str) -> Any:
    transformers = _transformers(name)
    try:
        return transformers.AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelSpecError(
            f"MODEL {name!r} is not a local file or directory, not a module:function factory, and not a transformers "
            f"config in the local cache (looked up offline only: {str(exc).splitlines()[0]}). Pass the path of its "
            f"config.json, or fetch it where there is a network (hf download {name} config.json)"
        ) from None


def _transformers(what: str) -> Any:
    try:
        return importlib.import_module("transformers")
    except ImportError:
        raise ModelSpecError(f"MODEL {what!r} is a transformers config, but transformers is not installed "
                             "(pip install transformers)") from None


def _from_transformers(config: Any, spec: str) -> Callable[[], torch.nn.Module]:
    transformers = _transformers(spec)
    classes = [getattr(transformers, arch, None) for arch in (getattr(config, "architectures", None) or [])]
    classes = [cls for cls in classes if cls is not None]

    def build() -> torch.nn.Module:
        if classes:
            return classes[0](config)
        for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
            try:
                return auto.from_config(config)
            except ValueError:
                continue
        raise ModelSpecError(f"MODEL {spec!r}: transformers has no model class for model_type "
                             f"{getattr(config, 'model_type', '?')!r}")

    return build


# -- measuring it --------------------------------------------------------------------------


def parameter_infos(model: torch.nn.Module) -> tuple[ParameterInfo, ...]:
    return tuple(ParameterInfo(p.numel(), p.shape[0] if p.dim() else 1, str(p.dtype).removeprefix("torch."),
                               p.requires_grad) for p in model.parameters())


def largest_unit(model: torch.nn.Module) -> tuple[int, str]:
    """Elements and name of the largest member of the model's ``ModuleList`` s (FSDP2 wraps repeated
    blocks); the whole model when it repeats nothing."""
    best, name = 0, ""
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            for index, block in enumerate(module):
                count = sum(p.numel() for p in block.parameters())
                if count > best:
                    best, name = count, f"{path}.{index} ({type(block).__name__})"
    if not best:
        return sum(p.numel() for p in model.parameters()), "the whole model (no repeated blocks)"
    return best, name


def example_inputs(model: torch.nn.Module, batch_size: int, seq_len: int) -> tuple[tuple[Any, ...], dict[str, Any]] | str:
    """Arguments for one forward on the model's device, or why none can be made.

    A model's own ``example_inputs(batch_size, seq_len)`` wins (returns args, or ``(args, kwargs)``);
    a transformers model gets ``input_ids`` (and ``labels`` when its forward takes them); otherwise
    the first layer decides: ``Linear`` takes ``(batch, in_features)`` floats, ``Embedding``
    ``(batch, seq_len)`` token ids.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    own = getattr(model, "example_inputs", None)
    if callable(own):
        with torch.device(device):
            made = own(batch_size, seq_len)
        if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], dict):
            return tuple(made[0]), made[1]
        return (made if isinstance(made, tuple) else (made,)), {}
    if hasattr(model, "config") and hasattr(model, "get_input_embeddings"):
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
        takes_labels = "labels" in inspect.signature(model.forward).parameters
        return (), ({"input_ids": ids, "labels": ids} if takes_labels else {"input_ids": ids})
    first = next((m for m in model.modules() if not list(m.children())), None)
    if isinstance(first, torch.nn.Linear):
        return (torch.zeros(batch_size, first.in_features, device=device),), {}
    if isinstance(first, torch.nn.Embedding):
        return (torch.zeros(batch_size, seq_len, dtype=torch.long, device=device),), {}
    return (f"no example input for a model whose first layer is {type(first).__name__}: give the model an "
            "example_inputs(batch_size, seq_len) method")


def training_loss(output: Any) -> torch.Tensor:
    """The scalar to call backward on: a model output's ``loss``, else the sum of its first tensor."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)):
        output = output[0]
    if isinstance(output, dict):
        output = output.get("loss", next(iter(output.values())))
    return output.float().sum()


def saved_activation_bytes(model: torch.nn.Module, batch_size: int, seq_len: int) -> tuple[int | None, str]:
    """Bytes one forward (and its loss) saves for backward, or ``(None, why)``."""
    made = example_inputs(model, batch_size, seq_len)
    if isinstance(made, str):
        return None, made
    args, kwargs = made
    counter = SavedTensorCounter(model.parameters())
    try:
        with torch.enable_grad(), fused_attention_on_meta(), counter:
            training_loss(model(*args, **kwargs))
    except Exception as exc:  # noqa: BLE001 — a forward that needs real data (``.item()``, data-dependent shapes)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return None, f"the forward cannot run on the meta device ({type(exc).__name__}: {first[:200]})"
    return counter.bytes, f"batch_size={batch_size}, seq_len={seq_len}, fp32, no activation checkpointing"


def footprint(model: torch.nn.Module, name: str, *, batch_size: int, seq_len: int,
              activations: bool = True) -> ModelFootprint:
    """Measure ``model`` (normally on the meta device)."""
    unit, unit_name = largest_unit(model)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    act_bytes, note = (saved_activation_bytes(model, batch_size, seq_len) if activations
                       else (None, "not asked for (--no_activations)"))
    return ModelFootprint(name=name, parameters=parameter_infos(model), buffer_bytes=buffers, unit_parameters=unit,
                          unit_name=unit_name, activation_bytes=act_bytes, activation_note=note,
                          hidden_size=getattr(getattr(model, "config", None), "hidden_size", None))


__all__ = [
    "ModelSpecError",
    "SavedTensorCounter",
    "build_on_meta",
    "example_inputs",
    "footprint",
    "fused_attention_on_meta",
    "largest_unit",
    "parameter_infos",
    "resolve_model",
    "saved_activation_bytes",
    "training_loss",
]
