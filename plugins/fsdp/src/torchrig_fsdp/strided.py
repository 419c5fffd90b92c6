"""Strided shards in checkpoints, exactly.

A fused projection split part by part under tensor parallel (transformers' packed styles, e.g. a
Qwen3-MoE's ``experts.gate_up_proj``) is a DTensor placed ``_StridedShard``: each rank's chunk is
several slices of the full tensor (FSDP2's ``_StridedShard`` over a tensor-parallel shard of the
same dimension is not: its chunk is one block, and it is left as it is). torch 2.13 places such a chunk by one offset and one shape
(``compute_local_shape_and_global_offset``) in two places, silently wrong for any other layout:

* DCP writes and reads the chunk as one contiguous block — the same layout round-trips, but another
  mesh, one process or ``merge-weights`` gets the parts in the wrong places. So a strided DTensor is
  redistributed to the plain ``Shard`` of the same dimension before DCP sees it (the files hold the
  true tensor), and loaded into a ``Shard`` stand-in redistributed back afterwards.
* ``set_model_state_dict``/``set_optimizer_state_dict`` with ``broadcast_from_rank0`` (full state
  dicts: ``FULL_STATE_DICT``, a DDP or one-process checkpoint) copy one contiguous slice into it.
  So after them, each strided tensor is broadcast whole from rank 0 and sliced the way its
  placements split it (:func:`place_from_rank0`), one tensor at a time.

Other tensors are untouched; the cost is one redistribution (or broadcast) of the strided ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import empty as dtensor_empty
from torch.distributed.tensor.placement_types import _StridedShard


def is_strided(value: Any) -> bool:
    """A DTensor whose local chunk is not one block of the full tensor (a ``_StridedShard`` not
    undone by a later shard of the same dimension, as FSDP2 over tensor parallel's is)."""
    if not isinstance(value, DTensor) or not any(isinstance(p, _StridedShard) for p in value.placements):
        return False
    return any(bool((index.diff() != 1).any()) for index in _local_indices(value) if index.numel() > 1)


def _local_indices(value: DTensor) -> list[torch.Tensor]:
    """Per dimension, the global indices this rank's chunk holds: a 1-D index split the way
    ``value``'s placements split that dimension (no communication)."""
    indices = []
    for dim, size in enumerate(value.shape):
        placements = [(_StridedShard(0, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(0))
                      if isinstance(p, (Shard, _StridedShard)) and p.dim == dim else Replicate() for p in value.placements]
        index = torch.arange(size)
        if any(not isinstance(p, Replicate) for p in placements):
            index = distribute_tensor(index, value.device_mesh, placements, src_data_rank=None).to_local()
        indices.append(index)
    return indices


def _contiguous_placements(value: DTensor) -> tuple[Any, ...]:
    return tuple(Shard(p.dim) if isinstance(p, _StridedShard) else p for p in value.placements)


def _map(state: Any, change: Callable[[Any], Any]) -> Any:
    """A copy of the nested dicts/lists/tuples of ``state`` with each leaf passed through ``change``."""
    if isinstance(state, dict):
        return {key: _map(value, change) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_map(value, change) for value in state)
    return change(state)


# -- through DCP ----------------------------------------------------------------------------------


def for_saving(state: Any) -> Any:
    """``state`` with every strided DTensor redistributed to contiguous shards (same values)."""
    def contiguous(value: Any) -> Any:
        return value.redistribute(value.device_mesh, _contiguous_placements(value)) if is_strided(value) else value
    return _map(state, contiguous)


def load(state: Any, read: Callable[[Any], None]) -> Any:
    """Run ``read`` (a DCP load filling the tensors of the state it is given in place) on ``state``
    with contiguous stand-ins for its strided DTensors; returns the state with the stand-ins
    redistributed back to the original placements (the other entries are the ones given)."""
    originals: dict[int, DTensor] = {}

    def stand_in(value: Any) -> Any:
        if not is_strided(value):
            return value
        contiguous = dtensor_empty(value.shape, dtype=value.dtype, device_mesh=value.device_mesh,
                                   placements=_contiguous_placements(value), requires_grad=False)
        originals[id(contiguous)] = value
        return contiguous

    standing = _map(state, stand_in)
    read(standing)

    def restore(value: Any) -> Any:
        original = originals.get(id(value))
        return value if original is None else value.redistribute(original.device_mesh, original.placements)

    return _map(standing, restore)


# -- from full state on rank 0 ----------------------------------------------------------------------


def model_targets(model: torch.nn.Module) -> dict[str, DTensor]:
    """This rank's strided parameters, by name."""
    return {name: param for name, param in model.named_parameters() if is_strided(param)}


def optimizer_targets(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[tuple[str, str], DTensor]:
    """This rank's strided optimizer state tensors, by (parameter name, state key)."""
    return {(name, key): value for name, param in model.named_parameters() if is_strided(param)
            for key, value in optimizer.state.get(param, {}).items() if is_strided(value)}


def place_from_rank0(targets: Mapping[Any, DTensor], full: Callable[[Any], torch.Tensor], device: torch.device) -> None:
    """Copy into each strided DTensor of ``targets`` its part of the full tensor ``full(key)``
    (called on rank 0 only), broadcast whole from rank 0, one tensor at a time. Collective: the
    keys are agreed first (a pipeline stage holds only its own)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sorted(targets, key=repr))
    keys = sorted({key for keys in everyone for key in keys}, key=repr)
    if not keys:
        return
    shapes = [[(tuple(full(key).shape), full(key).dtype) for key in keys] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shapes, src=0)
    with torch.no_grad():
        for key, (shape, dtype) in zip(keys, shapes[0]):
            whole = full(key).to(device) if dist.get_rank() == 0 else torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(whole, src=0)
            target = targets.get(key)
            if target is not None:
                part = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(part.to_local())
            del whole


__all__ = ["for_saving", "is_strided", "load", "model_targets", "optimizer_targets", "place_from_rank0"]
