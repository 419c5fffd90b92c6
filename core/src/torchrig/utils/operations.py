"""Accelerate's free-function collectives — ``gather``, ``reduce``, ``broadcast``... — over every
process of the job, usable without holding an ``Accelerator`` (the structure helpers they work on
are in :mod:`torchrig.distributed.nested`).

They use the collectives of the process's newest run (an ``Accelerator``'s or a ``PartialState``'s,
so a strategy's own transport is honoured), or plain ``torch.distributed`` over a process group
someone else created, or — with one process — return their input as a multi-process call would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from torchrig.compat.resolve import module_attributes
from torchrig.distributed.nested import recursively_apply
from torchrig.distributed.process import world_collectives
from torchrig.host.runtime import latest_run


def gather(tensor: Any) -> Any:
    """Every process's tensors concatenated along dim 0 (uneven first dimensions allowed)."""
    return world_collectives().gather(tensor)


def gather_object(obj: Any) -> list[Any]:
    """Every process's picklable object, as a list indexed by process (lists are flattened)."""
    return world_collectives().gather_object(obj)


def broadcast(tensor: Any, from_process: int = 0) -> Any:
    """Every process's tensors replaced by process ``from_process``'s (same shapes everywhere)."""
    return world_collectives().broadcast(tensor, src=from_process)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """In place: every process's list becomes process ``from_process``'s."""
    return world_collectives().broadcast_object_list(object_list, src=from_process)


def reduce(tensor: Any, reduction: str = "mean", scale: float = 1.0) -> Any:
    """Element-wise ``mean`` (the default here, as in Accelerate), ``sum``, ``max``, ``min`` or
    ``product`` over every process, times ``scale``; ``none`` returns a copy unreduced."""
    if reduction == "none":
        result = recursively_apply(torch.clone, tensor)
    else:
        result = world_collectives().reduce(tensor, reduction)
    return result if scale == 1.0 else recursively_apply(lambda t: t * scale, result)


def pad_across_processes(tensor: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad ``dim`` of every tensor to its largest size over the processes, so they can be gathered."""
    return world_collectives().pad_across(tensor, dim, pad_index, pad_first)


def copy_tensor_to_devices(tensor: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor that exactly one process holds (the others pass None), on every process."""
    collectives = world_collectives()
    described = collectives.gather_object([None if tensor is None else (tuple(tensor.shape), tensor.dtype)])
    holders = [rank for rank, info in enumerate(described) if info is not None]
    if len(holders) != 1:
        raise ValueError(f"copy_tensor_to_devices: exactly one process must pass a tensor; processes {holders} did")
    shape, dtype = described[holders[0]]
    if tensor is None:
        run = latest_run()
        device = run.device.device if run is not None and run.device is not None else "cpu"
        tensor = torch.zeros(shape, dtype=dtype, device=device)
    return collectives.broadcast(tensor, src=holders[0])


def wait_for_everyone() -> None:
    """Barrier across every process of the job."""
    world_collectives().barrier()


@contextlib.contextmanager
def no_parameter_gathering(params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                           enabled: bool = True) -> Iterator[None]:
    """``GatheredParameters`` when no installed plugin provides it: without ZeRO-3 every
    parameter is already whole, so there is nothing to gather."""
    yield


__all__ = ["broadcast", "broadcast_object_list", "copy_tensor_to_devices", "gather", "gather_object",
           "no_parameter_gathering", "pad_across_processes", "reduce", "wait_for_everyone"]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
