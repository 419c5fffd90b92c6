"""Measure the memory a training step really holds, to check estimates against (CPU or any device).

:func:`live_storages` walks every tensor the garbage collector tracks and records each storage
once (by address), so a measurement taken before building a model and one after its first step
differ by exactly what the model, its gradients, its optimizer and the strategy's own buffers hold
— whichever library allocated them (FSDP2's DTensor shards, DeepSpeed's flat partitions).
Activations are measured with :class:`torchrig.estimate.memory_model.SavedTensorCounter` on a real batch.
In a process that has built much (a test worker after hundreds of tests), :func:`only_new_objects` keeps the
walk to what a measurement made: milliseconds instead of a second each.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from collections.abc import Iterator

import torch


def live_storages() -> dict[int, int]:
    """``{address: bytes}`` of the storage of every live, materialised tensor (meta excluded)."""
    gc.collect()
    found: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on deprecated objects (torch.distributed.reduce_op) warns
        warnings.simplefilter("ignore", FutureWarning)
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in tensors:
        if obj.device.type == "meta":
            continue
        try:
            storage = obj.untyped_storage()
            size = storage.nbytes()
            if size:
                found[storage.data_ptr()] = size
        except (RuntimeError, NotImplementedError):  # no real storage: DTensor wrappers, freed FSDP2 buffers
            continue
    return found


def bytes_held_since(baseline: dict[int, int]) -> int:
    """Bytes of live storages that were not live in ``baseline`` (a :func:`live_storages` result)."""
    return sum(size for address, size in live_storages().items() if baseline.get(address) != size)


@contextlib.contextmanager
def only_new_objects() -> Iterator[None]:
    """Within the block, :func:`live_storages` (and the garbage collector) see only objects made inside it:
    the heap before is frozen (``gc.freeze``). Take the baseline inside the block; a tensor made before it
    stays invisible even if its storage changes inside. Where nothing was frozen before, the heap is thawed
    after; where it was (the test suite freezes what collection built) it stays frozen, since Python cannot
    thaw a part: what was alive at the block's start and dies later in a reference cycle is not collected —
    make the objects the measurement needs inside the block."""
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()


__all__ = ["bytes_held_since", "live_storages", "only_new_objects"]
