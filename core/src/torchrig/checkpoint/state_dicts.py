"""Plain state-dict checkpoint state: the core's default for strategies that replicate the model.

The main process writes each model's weights (``model.safetensors``, ``model_1.safetensors``...
or ``pytorch_model.bin`` without safe serialization — Accelerate's names) and each optimizer's
state (``optimizer.safetensors``, ``optimizer_1.safetensors``...: tensors, with the rest of the
state as JSON in the metadata; ``optimizer.bin`` via ``torch.save`` when it holds other objects)
through the checkpoint writer; every rank loads them. The commit protocol around these files is :mod:`torchrig.checkpoint`'s job.

safetensors refuses tensors that share memory (tied weights): each shared tensor is written
once and the other names are recorded in the file's metadata, then restored on load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from torchrig.checkpoint import topology
from torchrig.checkpoint.direct_read import read_into
from torchrig.checkpoint.files import CheckpointError
from torchrig.checkpoint.layout import numbered
from torchrig.checkpoint.trust import check_loadable

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.checkpoint.files import CheckpointWriter
    from torchrig.host.run import RunContext
    from torchrig.plugin.types import PreparedModel

#: safetensors metadata key of ``{alias: kept name}`` for tensors written once (tied weights).
ALIASES_KEY = "torchrig_aliases"


def _optimizer_names(model_index: int, prepared: Sequence[PreparedModel]) -> list[str]:
    """File stems (``optimizer``, ``optimizer_1``...): ``.safetensors``, or ``.bin`` for states
    that hold more than tensors and JSON values."""
    first = sum(len(item.optimizers) for item in prepared[:model_index])
    return [numbered("optimizer", first + j, "") for j in range(len(prepared[model_index].optimizers))]


def split_aliases(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors with each shared storage kept once, and ``{alias: kept name}`` for the rest."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[Any, int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, tensor in state.items():
        if tensor.device.type == "meta" or tensor.numel() == 0:
            kept[name] = tensor
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        if key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            kept[name] = tensor
    return kept, aliases


class _NotPlain(Exception):
    """A state holds something neither a tensor nor JSON: it is written with ``torch.save``."""


def encode_structure(state: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """JSON skeleton of a nested state (dict keys keep their types), its tensors moved to ``tensors``.

    A tensor is named by its dotted path, which is not unique: ``{"a.b": t1, "a": {"b": t2}}`` and
    ``{1: t3, "1": t4}`` flatten to one name each. A name already taken gets the first free
    ``<path>#<n>``, and the skeleton records the name each tensor was given, so every tensor comes
    back under its own key. The names depend only on the structure and its order, so a live state
    of the same structure gets the same names (direct reads match by name)."""
    if isinstance(state, torch.Tensor):
        name = path
        suffix = 0
        while name in tensors:
            suffix += 1
            name = f"{path}#{suffix}"
        tensors[name] = state
        return {"__tensor__": name}
    if isinstance(state, Mapping):
        return {"__dict__": [[encode_key(k), encode_structure(v, tensors, f"{path}.{k}")] for k, v in state.items()]}
    if isinstance(state, (list, tuple)):
        items = [encode_structure(v, tensors, f"{path}.{i}") for i, v in enumerate(state)]
        return items if isinstance(state, list) else {"__tuple__": items}
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    raise _NotPlain(type(state).__name__)


def encode_key(key: Any) -> Any:
    if key is None or isinstance(key, (bool, int, float, str)):
        return key
    raise _NotPlain(type(key).__name__)


def decode_structure(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__dict__" in skeleton:
            return {k: decode_structure(v, tensors) for k, v in skeleton["__dict__"]}
        if "__tuple__" in skeleton:
            return tuple(decode_structure(v, tensors) for v in skeleton["__tuple__"])
    if isinstance(skeleton, list):
        return [decode_structure(v, tensors) for v in skeleton]
    return skeleton


_STRUCTURE_KEY = "torchrig_structure"


def save_structured(writer: CheckpointWriter, state: Any, stem: str, fault_phase: str | None = None, *,
                    what: str | None = None, suffix: str = ".bin") -> str:
    """A nested state (an optimizer's) as safetensors plus its JSON skeleton in the metadata —
    as fast to write and read as plain weights, and no pickle; ``torch.save`` (``stem + suffix``)
    when it holds anything else, after checking ``torch.load(weights_only=True)`` reads it back
    (``what`` names the object in the error)."""
    tensors: dict[str, torch.Tensor] = {}
    try:
        skeleton = encode_structure(state, tensors)
    except _NotPlain:
        check_loadable(state, what or stem)
        return writer.save_torch(state, f"{stem}{suffix}", fault_phase=fault_phase)
    kept, aliases = split_aliases(tensors)
    metadata = {_STRUCTURE_KEY: json.dumps(skeleton)}
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases)
    return writer.save_tensors(kept, f"{stem}.safetensors", metadata=metadata, fault_phase=fault_phase)


def read_safetensors(path: str, location: Any = "cpu",
                     into: Mapping[str, Any] | None = None) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A safetensors file's tensors (aliases restored) and metadata; tensors of ``into`` that match
    an entry exactly are read in place and returned as themselves (:mod:`~torchrig.checkpoint.direct_read`)."""
    state, metadata = read_into(path, into or {}, location)
    for alias, name in json.loads(metadata.get(ALIASES_KEY, "{}")).items():
        state[alias] = state[name]
    return state, metadata


def _live_tensors(state: Any) -> dict[str, torch.Tensor]:
    """The tensors of a live nested state under the names :func:`encode_structure` gives them —
    the names its saved copy has — or none when it holds something the encoding does not."""
    tensors: dict[str, torch.Tensor] = {}
    try:
        encode_structure(state, tensors)
    except _NotPlain:
        return {}
    return tensors


def load_structured(directory: str, stem: str, location: Any = "cpu", live: Any = None) -> Any:
    """A state written by :func:`save_structured`; tensors of the ``live`` state it replaces that
    match are read in place (the state returned holds them)."""
    safe = os.path.join(directory, f"{stem}.safetensors")
    if os.path.exists(safe):
        tensors, metadata = read_safetensors(safe, location, _live_tensors(live) if live is not None else None)
        return decode_structure(json.loads(metadata[_STRUCTURE_KEY]), tensors)
    return torch.load(os.path.join(directory, f"{stem}.bin"), map_location=location, weights_only=True)


def _all_tensors(state: Mapping[str, Any]) -> bool:
    return all(isinstance(value, torch.Tensor) for value in state.values())


def save_plain_state(run: RunContext, prepared: Sequence[PreparedModel], writer: CheckpointWriter) -> list[str]:
    """Write model and optimizer state dicts on the main process; returns the files written."""
    if not run.cluster.is_main_process:
        return []
    written = []
    for index, item in enumerate(prepared):
        state = item.unwrapped.state_dict()
        if writer.safe_serialization and _all_tensors(state):
            tensors, aliases = split_aliases(state)
            written.append(writer.save_tensors(tensors, numbered("model", index, ".safetensors"),
                                               metadata={ALIASES_KEY: json.dumps(aliases)} if aliases else None))
        else:
            check_loadable(state, f"model {index}")
            written.append(writer.save_torch(state, numbered("pytorch_model", index, ".bin")))
        first = sum(len(other.optimizers) for other in prepared[:index])
        for offset, (optimizer, stem) in enumerate(zip(item.optimizers, _optimizer_names(index, prepared))):
            written.append(save_structured(writer, optimizer.state_dict(), stem, fault_phase="mid_optimizer",
                                           what=f"optimizer {first + offset}"))
    return written


def model_files(index: int) -> tuple[str, str]:
    """The names model ``index`` is saved under: safetensors, or the ``.bin`` without safe serialization."""
    return numbered("model", index, ".safetensors"), numbered("pytorch_model", index, ".bin")


def _check_plain(run: RunContext, directory: str, manifest: Mapping[str, Any], models: int) -> None:
    listed = {entry.get("path") for entry in manifest.get("files", []) if isinstance(entry, Mapping)}
    for index in range(models):
        names = model_files(index)
        if not any(name in listed for name in names):
            saved, now = topology.saved(manifest), topology.current(run)
            raise CheckpointError(
                f"cannot load model {index} from {directory}: it was saved by the strategy {saved.get('strategy')!r} "
                f"under {topology.describe(saved)}, in a format the strategy {now.get('strategy')!r} "
                f"({topology.describe(now)}) cannot read (no {names[0]} or {names[1]}); resume it with the strategy "
                f"that saved it ({saved.get('strategy')!r} reshards to any layout), or load full weights exported "
                "from it (save_model) into the model")


def read_model_file(directory: str, index: int, location: Any = "cpu",
                    into: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The state dict of model ``index`` in a checkpoint, from whichever format it was saved in;
    tensors of ``into`` (a live state dict) that match are read in place."""
    safe, pickled = model_files(index)
    if os.path.exists(os.path.join(directory, safe)):
        return read_safetensors(os.path.join(directory, safe), location, into)[0]
    return torch.load(os.path.join(directory, pickled), map_location=location, weights_only=True)


def load_optimizer_state(optimizer: Any, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)``, copying into the optimizer's live state tensors where
    they match (shape, dtype, device) — as ``load_state_dict`` does for a module — instead of
    swapping them for the loaded ones: freeing the old state (hundreds of MB for Adam) would
    otherwise be most of the time a load takes, and the memory stays where it was."""
    live = optimizer.state_dict()["state"]  # the same tensor objects the optimizer holds
    with torch.no_grad():
        for index, loaded in state.get("state", {}).items():
            current = live.get(index)
            if not current:
                continue
            for key, value in list(loaded.items()):
                target = current.get(key)
                if (isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor) and target is not value
                        and target.shape == value.shape and target.dtype == value.dtype
                        and target.device == value.device and target.layout == torch.strided):
                    target.copy_(value)
                    loaded[key] = target
    optimizer.load_state_dict(state)


def load_model_state(model: torch.nn.Module, state: Mapping[str, Any]) -> None:
    """``model.load_state_dict(state)`` (strict), except for keys the model's own ``state_dict()`` writes but its
    ``load_state_dict`` does not read back — bitsandbytes' 4-bit layers write their quantization state
    (``weight.absmax``, ``weight.quant_map``, ...) beside the packed weight, derived from it: such a key is accepted
    when it equals the live value and refused, naming it, when it differs (a checkpoint of another base model)."""
    result = model.load_state_dict(state, strict=False)
    live = model.state_dict() if result.unexpected_keys else {}
    unexpected = [key for key in result.unexpected_keys
                  if not (isinstance(live.get(key), torch.Tensor) and isinstance(state[key], torch.Tensor)
                          and torch.equal(live[key].cpu(), state[key].cpu()))]
    if result.missing_keys or unexpected:
        raise RuntimeError(f"Error(s) in loading state_dict for {type(model).__name__}: missing keys: "
                           f"{result.missing_keys}; unexpected keys (or a model-written key whose value differs "
                           f"from this model's): {unexpected}")


def load_plain_state(run: RunContext, prepared: Sequence[PreparedModel], directory: str,
                     manifest: Mapping[str, Any] | None = None) -> None:
    """Load what :func:`save_plain_state` wrote, onto this rank's device. A checkpoint whose
    manifest lists no plain model file (a sharded strategy's) is refused naming both layouts."""
    assert run.device is not None
    location = run.device.device
    if manifest is not None and "files" in manifest:
        _check_plain(run, directory, manifest, len(prepared))
    for index, item in enumerate(prepared):
        model = item.unwrapped
        load_model_state(model, read_model_file(directory, index, "cpu", into=model.state_dict()))
        for optimizer, stem in zip(item.optimizers, _optimizer_names(index, prepared)):
            load_optimizer_state(optimizer, load_structured(directory, stem, location, live=optimizer.state_dict()))


__all__ = ["ALIASES_KEY", "load_model_state", "load_optimizer_state", "load_plain_state", "model_files", "load_structured", "read_model_file", "save_plain_state", "save_structured", "split_aliases"]
