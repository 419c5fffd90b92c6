"""Plain state-dict checkpoint state: the core's default for strategies that replicate the model.

The main process writes each model's weights (``model.safetensors``, ``model_1.safetensors``...
or ``pytorch_model.bin`` without safe serialization — Accelerate's names) and each optimizer's
state (``optimizer.bin``, ``optimizer_1.bin``...) through the checkpoint writer; every rank
loads them. The commit protocol around these files is :mod:`torchrig.checkpoint`'s job.

safetensors refuses tensors that share memory (tied weights): each shared tensor is written
once and the other names are recorded in the file's metadata, then restored on load.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.checkpoint.files import CheckpointWriter
    from torchrig.run import RunContext
    from torchrig.types import PreparedModel

_ALIASES_KEY = "torchrig_aliases"


def _numbered(stem: str, index: int, suffix: str) -> str:
    return f"{stem}{'' if index == 0 else f'_{index}'}{suffix}"


def _optimizer_names(model_index: int, prepared: Sequence[PreparedModel]) -> list[str]:
    first = sum(len(item.optimizers) for item in prepared[:model_index])
    return [_numbered("optimizer", first + j, ".bin") for j in range(len(prepared[model_index].optimizers))]


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
            written.append(writer.save_tensors(tensors, _numbered("model", index, ".safetensors"),
                                               metadata={_ALIASES_KEY: json.dumps(aliases)} if aliases else None))
        else:
            written.append(writer.save_torch(state, _numbered("pytorch_model", index, ".bin")))
        for optimizer, name in zip(item.optimizers, _optimizer_names(index, prepared)):
            written.append(writer.save_torch(optimizer.state_dict(), name, fault_phase="mid_optimizer"))
    return written


def read_model_file(directory: str, index: int, location: Any = "cpu") -> dict[str, Any]:
    """The state dict of model ``index`` in a checkpoint, from whichever format it was saved in."""
    safe = os.path.join(directory, _numbered("model", index, ".safetensors"))
    if os.path.exists(safe):
        from safetensors import safe_open

        with safe_open(safe, framework="pt", device=str(location)) as handle:
            state = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - not a dict
            metadata = handle.metadata() or {}
        for alias, name in json.loads(metadata.get(_ALIASES_KEY, "{}")).items():
            state[alias] = state[name]
        return state
    return torch.load(os.path.join(directory, _numbered("pytorch_model", index, ".bin")), map_location=location,
                      weights_only=True)


def load_plain_state(run: RunContext, prepared: Sequence[PreparedModel], directory: str) -> None:
    """Load what :func:`save_plain_state` wrote, onto this rank's device."""
    assert run.device is not None
    location = run.device.device
    for index, item in enumerate(prepared):
        item.unwrapped.load_state_dict(read_model_file(directory, index, "cpu"))
        for optimizer, name in zip(item.optimizers, _optimizer_names(index, prepared)):
            optimizer.load_state_dict(torch.load(os.path.join(directory, name), map_location=location, weights_only=True))


__all__ = ["load_plain_state", "read_model_file", "save_plain_state", "split_aliases"]
