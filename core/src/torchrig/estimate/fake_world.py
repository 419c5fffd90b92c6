"""One rank of a world that does not exist: torch's fake process group, for ``torchrig plan``.

Why: a run at 256 or 1024 GPUs cannot be tried here, yet most of what fails there fails at
``prepare`` (a mesh that does not divide the world, heads that do not divide over ``tp``, a
pipeline stage without layers) and what decides whether it fits is the per-rank layout. Torch's
fake process group (``backend="fake"``) lets one CPU process be rank ``r`` of ``W``: the real
``DeviceMesh`` is built, FSDP2/TP/pipelining lay out the real shards, every collective returns at
once without communicating. Each representative rank is planned in turn, each in a fresh fake
world (:func:`fake_world`), so per-rank state (the mesh, the run) never leaks from one to the next.

The fake backend is registered by ``torch.testing._internal.distributed.fake_pg`` (torch has no
public home for it in 2.13); tests/estimate/test_fake_world.py fails loudly when a torch release
moves it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore

from torchrig.distributed.process_group import FAKE_BACKEND
from torchrig.errors import TorchrigError


class FakeWorldError(TorchrigError):
    """A fake world cannot be opened here (a real process group exists, or the shape is impossible)."""


def world_environment(world_size: int, rank: int, local_world_size: int) -> dict[str, str]:
    """The variables a launcher would give rank ``rank`` of ``world_size`` at ``local_world_size``
    processes per machine, as torchelastic names them (what the cluster detection reads)."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank % local_world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(rank // local_world_size),
            "NODE_RANK": str(rank // local_world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@contextlib.contextmanager
def fake_world(world_size: int, rank: int, *, local_world_size: int) -> Iterator[None]:
    """Be rank ``rank`` of ``world_size`` (``local_world_size`` per machine) until the block ends:
    torch's fake process group as the default group, destroyed on exit (with every group a mesh
    created on it). The launcher's variables (:func:`world_environment`) are the caller's to set,
    with whatever else a launched rank would see."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise FakeWorldError(f"rank {rank} of a world of {world_size}: the rank must lie in [0, {world_size})")
    if local_world_size < 1 or world_size % local_world_size:
        raise FakeWorldError(f"{world_size} processes do not fill machines of {local_world_size} processes each; "
                             "the world size must be a multiple of the processes per machine")
    if dist.is_initialized():
        raise FakeWorldError("this process already has a default process group; planning runs in a process of its own "
                             "(the `torchrig plan` command, or destroy the group first)")
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor's sharding-propagation cache compares meshes by value: the next fake world's equal
        # mesh would find specs that point at this world's destroyed groups
        _clear_sharding_prop_cache()


def in_fake_world() -> bool:
    """Whether the default process group is torch's fake one (this process plans a run)."""
    return dist.is_available() and dist.is_initialized() and FAKE_BACKEND in str(dist.get_backend())


__all__ = ["FAKE_BACKEND", "FakeWorldError", "fake_world", "in_fake_world", "world_environment"]
