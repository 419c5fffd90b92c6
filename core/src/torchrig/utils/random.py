"""Seeding, and making random number generators identical on every process."""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from typing import Any

import torch

from torchrig.compat.enums import RNGType
from torchrig.compat.resolve import module_attributes
from torchrig.distributed.process import world_collectives


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python, NumPy (if installed) and torch (CPU and every CUDA device).

    ``device_specific`` adds the process rank to the seed (different augmentations per rank);
    ``deterministic`` asks torch for deterministic algorithms.
    """
    if device_specific:
        seed += int(os.environ.get("RANK", "0")) if not torch.distributed.is_initialized() else torch.distributed.get_rank()
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def synchronize_rng_state(rng_type: RNGType | str | None = None, generator: Any = None) -> None:
    """Make one generator's state on every process equal to the main process's: ``torch`` (the CPU
    generator), ``cuda`` (this process's device) or ``generator`` (the one given)."""
    import torch

    kind = RNGType(str(rng_type)) if rng_type is not None else RNGType.TORCH
    if kind is RNGType.TORCH:
        state, apply = torch.get_rng_state(), torch.set_rng_state
    elif kind is RNGType.CUDA:
        state, apply = torch.cuda.get_rng_state(), torch.cuda.set_rng_state
    elif kind is RNGType.GENERATOR:
        if generator is None:
            raise ValueError("synchronize_rng_state(RNGType.GENERATOR) needs the generator: pass generator=...")
        state, apply = generator.get_state(), generator.set_state
    else:
        raise ValueError(f"synchronize_rng_state: RNG type {kind.value!r} is for a device torchrig does not support; "
                         "use 'torch', 'cuda' or 'generator'")
    apply(world_collectives().broadcast_object_list([state])[0])


def synchronize_rng_states(rng_types: Iterable[RNGType | str], generator: Any = None) -> None:
    """:func:`synchronize_rng_state` for each of ``rng_types``."""
    for rng_type in rng_types:
        synchronize_rng_state(rng_type, generator=generator)


__all__ = ["set_seed", "synchronize_rng_state", "synchronize_rng_states"]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
