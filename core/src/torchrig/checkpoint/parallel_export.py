"""``save_model`` written by every rank at once, when the layout allows it.

When every tensor of a model's state is a DTensor (FSDP2, TP, FSDP2×TP, HSDP) and every rank
holds the same names, the weights files are split between the ranks: file ``i`` belongs to rank
``i % world``. The files are made in rounds of ``world``: each tensor of the round's files is
gathered (``full_tensor()``, collective, one tensor at a time), its owner keeps it and the others
drop it at once; then every owner writes its file concurrently. A rank holds at most one file's
tensors plus one gathered tensor, and no rank ever holds the whole model. The files are those
:func:`~torchrig.checkpoint.export.save_weights` writes (same split, names, index, atomic writes,
stale shards removed); rank 0 writes the index and the config last, after every rank's files
are in place. Other layouts (a pipeline stage holds only its own names; DeepSpeed ZeRO-3's
parameters are not DTensors) go through the strategy's gathered full state dict instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from torchrig.checkpoint.export import (
    SAFE_INDEX,
    SAFE_WEIGHTS,
    parse_size,
    shard,
    shard_names,
    write_atomic,
    write_index_and_prune,
)
from torchrig.checkpoint.files import CheckpointError, fsync_path
from torchrig.checkpoint.hf_names import tied_targets, transformers_state, write_config_files


def _is_dtensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and hasattr(value, "full_tensor") and hasattr(value, "placements")


def _undeclared_ties(model: torch.nn.Module) -> bool:
    """Whether two names share a parameter beyond the ties the model declares."""
    declared = set(tied_targets(model))
    seen: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen and name not in declared and seen[id(param)] not in declared:
            return True
        seen.setdefault(id(param), name)
    return False


def parallel_state(model: torch.nn.Module) -> dict[str, Any] | None:
    """The state to write in parallel (transformers' names, DTensors), or None where the layout
    does not allow it. Collective: every rank gets the same answer."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    state = transformers_state(model.state_dict(), model)
    mine = bool(state) and all(_is_dtensor(value) for value in state.values()) and not _undeclared_ties(model)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (mine, list(state)))
    if all(ok for ok, _ in gathered) and all(keys == gathered[0][1] for _, keys in gathered):
        return state
    return None


def _agree(error: str | None, what: str) -> None:
    """Raise on every rank if any rank failed (naming the ranks and their errors)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    failed = {rank: message for rank, message in enumerate(gathered) if message}
    if failed:
        listed = "; ".join(f"rank {rank}: {message}" for rank, message in failed.items())
        raise CheckpointError(f"save_model: {what} failed — {listed}")


def save_in_parallel(model: torch.nn.Module, state: Mapping[str, Any], directory: str,
                     max_shard_size: int | str = "10GB") -> list[str]:
    """Write ``state`` (from :func:`parallel_state`) as safetensors split between the ranks, and
    the config files; collective. Returns the files this rank wrote."""
    rank, world = dist.get_rank(), dist.get_world_size()
    limit = parse_size(max_shard_size)
    error = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            error = f"cannot create {directory}: {exc}"
    _agree(error, f"creating {directory}")
    shards = shard(state, limit)
    names = shard_names(SAFE_WEIGHTS, len(shards))
    written: list[str] = []
    error = None
    for first in range(0, len(shards), world):
        kept: dict[str, torch.Tensor] = {}
        mine = None
        for index in range(first, min(first + world, len(shards))):
            for name, value in shards[index].items():
                full = value.full_tensor()  # collective over the tensor's mesh, in the same order everywhere
                if index % world == rank:
                    kept[name] = full.detach().to("cpu").contiguous()
                    mine = index
                del full
        if mine is not None and error is None:
            path = os.path.join(directory, names[mine])
            try:
                write_atomic(path, lambda tmp, part=kept: save_file(part, tmp, metadata={"format": "pt"}))
                written.append(names[mine])
            except (CheckpointError, OSError) as exc:
                error = str(exc)
        del kept
    _agree(error, "writing the weights files")
    error = None
    if rank == 0:
        try:
            total = sum(value.numel() * value.element_size() for value in state.values())
            written += write_index_and_prune(directory, SAFE_WEIGHTS, SAFE_INDEX, names, shards, total)
            written += write_config_files(model, directory)
            fsync_path(directory)
        except (CheckpointError, OSError) as exc:
            error = str(exc)
    _agree(error, "writing the index and config")
    return written


def written_by_all(mine: list[str]) -> list[str]:
    """Every file the ranks wrote, on rank 0 (weights files in order, then the index and config
    files); ``[]`` elsewhere. Collective."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return []
    weights = sorted({name for part in gathered for name in part if name.endswith(".safetensors")})
    return weights + [name for name in gathered[0] if not name.endswith(".safetensors")]


__all__ = ["parallel_state", "save_in_parallel", "written_by_all"]
