"""Helpers with Accelerate's names: ``set_seed``, ``find_executable_batch_size``,
``release_memory``, ``send_to_device``."""

from __future__ import annotations

import os
import random

from torchrig.data import send_to_device
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



__all__ = ["find_executable_batch_size", "release_memory", "send_to_device", "set_seed", "should_reduce_batch_size"]
