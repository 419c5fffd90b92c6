"""Helpers with Accelerate's names: ``set_seed``, ``find_executable_batch_size``,
``gather_object``, ``send_to_device``."""

from __future__ import annotations

import os
import random
from typing import Any

from torchrig.utils.memory import find_executable_batch_size, release_memory, should_reduce_batch_size


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python, NumPy (if installed) and torch (CPU and every CUDA device).

    ``device_specific`` adds the process rank to the seed (different augmentations per rank);
    ``deterministic`` asks torch for deterministic algorithms.
    """
    import torch

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


def send_to_device(data: Any, device: Any, non_blocking: bool = False) -> Any:
    """Move every tensor in a nested structure (and objects with ``.to``, like BatchEncoding)."""
    from torchrig.collectives import recursively_apply

    if hasattr(data, "to") and not hasattr(data, "dim") and not isinstance(data, (list, tuple, dict)):
        try:
            return data.to(device, non_blocking=non_blocking)
        except TypeError:
            return data.to(device)
    return recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), data)


__all__ = ["find_executable_batch_size", "release_memory", "send_to_device", "set_seed", "should_reduce_batch_size"]
