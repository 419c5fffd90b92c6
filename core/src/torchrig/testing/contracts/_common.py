"""Shared pieces of the contract suites: the per-task environment, tiny models and batches.

Task functions are module-level so that they can be sent to the pool's workers with plain pickle.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any


def _elastic_environ(rank: int, world_size: int) -> dict[str, str]:
    """The variables torch elastic sets for rank ``rank`` of ``world_size``. The pool's process
    group already exists, so the Accelerator's default process-group setup reuses it and the
    rendezvous address is never contacted."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@contextlib.contextmanager
def rank_environment(rank: int, world_size: int, extra: Mapping[str, str] | None = None) -> Iterator[None]:
    """Set elastic's variables (and an empty TORCHRIG config home, and ``extra``) for one task,
    then restore the environment.

    Pool workers run many tasks in one interpreter: Accelerators of earlier tasks live in
    reference cycles until collected, and a live one of another strategy would refuse this
    task's (one strategy per process group), so they are collected first."""
    import gc

    gc.collect()
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("TORCHRIG_")]:
        del os.environ[key]
    home = tempfile.mkdtemp(prefix="torchrig-contract-home-")
    os.environ["TORCHRIG_CONFIG_HOME"] = home
    if world_size > 1:
        os.environ.update(_elastic_environ(rank, world_size))
    os.environ.update(extra or {})
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(home, ignore_errors=True)  # a test leaves the temp directory as it found it


class SingleProcess:
    """The task context of an in-process (world size 1) run: what a pool task's ``ctx`` offers."""

    rank, world_size = 0, 1


def tiny_model() -> Any:
    """A 6 → 12 → 3 MLP with fixed initial weights (seed 0)."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def tiny_batch(rank: int, size: int = 8, seed: int = 0) -> tuple[Any, Any]:
    """Inputs ``(size, 6)`` and class labels ``(size,)``, different for every rank and seed."""
    import torch

    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(size, 6, generator=generator), torch.randint(0, 3, (size,), generator=generator)


def flat_params(model: Any) -> list[float]:
    """Every parameter as a list of floats; sharded parameters (DTensors) are gathered first."""
    import torch

    def full(p: Any) -> Any:
        return p.full_tensor() if hasattr(p, "full_tensor") else p

    return torch.cat([full(p.detach()).reshape(-1).cpu() for p in model.parameters()]).tolist()


__all__ = ["SingleProcess", "flat_params", "rank_environment", "tiny_batch", "tiny_model"]
