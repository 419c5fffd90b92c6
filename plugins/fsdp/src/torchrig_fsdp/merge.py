"""Full weights out of an fsdp checkpoint: the work of ``torchrig merge-weights``.

One process, no process group: a DCP checkpoint written by any number of ranks is read shard by
shard into full tensors (``torch.distributed.checkpoint`` without distribution) and written as
safetensors. Tensors that share memory (tied weights loaded from a full ``.bin``) are written as
separate copies, so every name of the model's ``state_dict`` is present.
"""

from __future__ import annotations

import os
import re
import shutil

import torch
from torchrig.plugin import TorchrigError

from torchrig_fsdp.checkpoint import read_sharded_model

_SHARDED = re.compile(r"^pytorch_model_fsdp_(\d+)$")
_FULL = re.compile(r"^pytorch_model_fsdp(?:_(\d+))?\.bin$")


class MergeWeightsError(TorchrigError):
    """``torchrig merge-weights`` cannot do what it was asked; the message says why and what to do."""


def find_models(checkpoint: str) -> dict[int, str]:
    """Model index -> where its state is (a DCP directory or a full ``.bin``)."""
    if not os.path.isdir(checkpoint):
        raise MergeWeightsError(f"{checkpoint}: no such checkpoint directory")
    if os.path.isfile(os.path.join(checkpoint, ".metadata")):  # one DCP directory given directly
        match = _SHARDED.match(os.path.basename(os.path.normpath(checkpoint)))
        return {int(match.group(1)) if match else 0: checkpoint}
    found: dict[int, str] = {}
    for name in sorted(os.listdir(checkpoint)):
        sharded, full = _SHARDED.match(name), _FULL.match(name)
        if sharded and os.path.isdir(os.path.join(checkpoint, name)):
            found[int(sharded.group(1))] = os.path.join(checkpoint, name)
        elif full:
            found.setdefault(int(full.group(1) or 0), os.path.join(checkpoint, name))
    if not found:
        listing = ", ".join(sorted(os.listdir(checkpoint))[:12]) or "(empty)"
        raise MergeWeightsError(
            f"{checkpoint} holds no fsdp model state (pytorch_model_fsdp_<i>/ or pytorch_model_fsdp.bin); it contains: "
            f"{listing}. Checkpoints of other strategies already hold full weights (model.safetensors)")
    return found


def merge_weights(checkpoint: str, output: str, *, overwrite: bool = False, safe_serialization: bool = True) -> list[str]:
    """Write ``model.safetensors`` (``model_<i>.safetensors``; ``pytorch_model[_<i>].bin`` without
    ``safe_serialization``) into ``output`` for every model in ``checkpoint``; returns the paths written."""
    from safetensors.torch import save_file

    models = find_models(checkpoint)
    stem, suffix = ("model", ".safetensors") if safe_serialization else ("pytorch_model", ".bin")
    targets = {index: os.path.join(output, f"{stem}{suffix}" if index == 0 else f"{stem}_{index}{suffix}")
               for index in models}
    existing = [path for path in targets.values() if os.path.exists(path)]
    if existing and not overwrite:
        raise MergeWeightsError(f"{', '.join(existing)} already exist; pass --overwrite to replace them")
    os.makedirs(output, exist_ok=True)
    written = []
    for index, source in sorted(models.items()):
        state = read_sharded_model(source) if os.path.isdir(source) else _read_full(source)
        tensors = _unshared(state, source)
        target = targets[index]
        temporary = f"{target}.tmp-{os.getpid()}"
        if safe_serialization:
            save_file(tensors, temporary, metadata={"format": "pt", "source": os.path.abspath(source)})
        else:
            torch.save(tensors, temporary)
        with open(temporary, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(temporary, target)
        written.append(target)
    return written


def merge_fsdp_weights(checkpoint_dir: str, output_path: str, safe_serialization: bool = True,
                       remove_checkpoint_dir: bool = False) -> list[str]:
    """Accelerate's ``merge_fsdp_weights``: full weights of a sharded fsdp checkpoint, in one process.

    ``checkpoint_dir`` is a ``save_state`` checkpoint or one model's DCP directory
    (``pytorch_model_fsdp_0``); existing outputs are replaced, as in Accelerate, and with
    ``remove_checkpoint_dir`` the source directory is deleted once every file is written."""
    written = merge_weights(checkpoint_dir, output_path, overwrite=True, safe_serialization=safe_serialization)
    if remove_checkpoint_dir:
        shutil.rmtree(checkpoint_dir)
    return written


def _read_full(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def _unshared(state: dict[str, object], source: str) -> dict[str, torch.Tensor]:
    """Contiguous tensors, each with its own memory (safetensors refuses shared storage)."""
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise MergeWeightsError(f"{source}: entry {name!r} is a {type(value).__name__}, not a tensor; "
                                    "this is not a model state dict")
        value = value.detach().cpu().contiguous()
        key = value.untyped_storage().data_ptr()
        if value.numel() and key in seen:
            value = value.clone()
        seen.add(key)
        tensors[name] = value
    return tensors


__all__ = ["MergeWeightsError", "find_models", "merge_fsdp_weights", "merge_weights"]
