"""Seeds and samplers: every prepared loader shuffles from generators it owns (the rule of
:mod:`torchrig.data`), so any epoch can be regenerated and no pass touches the global RNG."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Sampler

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.distributed.collectives import Collectives


_MASK64 = (1 << 64) - 1
#: Mixed into the worker-seed generator's seed so it never equals the shuffling generator's.
_WORKER_SEED_SALT = 0x9E3779B97F4A7C15
STATE_VERSION = 1


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s shuffling generator: ``seed + epoch`` (as a 64-bit value)."""
    return (int(seed) + int(epoch)) & _MASK64


def worker_seed(seed: int, epoch: int) -> int:
    return ((int(seed) + int(epoch)) ^ _WORKER_SEED_SALT) & _MASK64


def seeded_generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def derive_seed(collectives: Collectives | None = None) -> int:
    """One seed drawn from the global torch RNG, the same on every rank.

    The draw (``torch.empty((), dtype=torch.int64).random_()``) is reproducible after
    ``set_seed``; broadcasting rank 0's value makes it identical on every rank even when ranks
    consumed their global RNG differently before (rank-dependent initialisation, a
    ``device_specific`` seed). Called once, at prepare time, never while iterating.
    """
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    if collectives is not None and collectives.active:
        seed = int(collectives.broadcast_object_list([seed], src=0)[0])
    return seed


class SeedableRandomSampler(Sampler[int]):
    """``RandomSampler`` whose epoch ``e`` is drawn from ``torch.Generator().manual_seed(seed + e)``.

    The algorithm is torch's own (``randperm`` per pass over the data, ``randint`` in chunks of 32
    with replacement), so the indices are bit-identical to a ``RandomSampler`` given that
    generator. Iterating yields the order of ``self.epoch``; :meth:`order` regenerates any epoch
    without touching any other RNG.
    """

    def __init__(
        self, data_source: Any, *, seed: int, replacement: bool = False, num_samples: int | None = None
    ) -> None:
        self.data_source = data_source
        self.seed = int(seed)
        self.replacement = replacement
        self._num_samples = num_samples
        self.epoch = 0
        self._generator = torch.Generator()

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s indices as an int64 tensor of length ``num_samples``."""
        n, count = len(self.data_source), self.num_samples
        generator = self._generator  # one per sampler, reseeded: no generator state allocated per epoch
        generator.manual_seed(epoch_seed(self.seed, epoch))
        parts: list[torch.Tensor] = []
        if self.replacement:
            for _ in range(count // 32):
                parts.append(torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator))
            parts.append(torch.randint(high=n, size=(count % 32,), dtype=torch.int64, generator=generator))
        elif n > 0:
            for _ in range(count // n):
                parts.append(torch.randperm(n, generator=generator))
            if count % n:
                parts.append(torch.randperm(n, generator=generator)[: count % n])
        if len(parts) == 1:  # one pass over the data (the usual case): no copy
            return parts[0]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch).tolist())

    def __len__(self) -> int:
        return self.num_samples


@contextlib.contextmanager
def lent_generator(objects: Sequence[Any], seed: int) -> Iterator[None]:
    """Temporarily give every object with a ``generator`` attribute a generator seeded ``seed``."""
    saved: list[tuple[Any, Any]] = []
    try:
        for obj in objects:
            if obj is not None and hasattr(obj, "generator"):
                saved.append((obj, obj.generator))
                obj.generator = seeded_generator(seed)
        yield
    finally:
        for obj, original in reversed(saved):
            obj.generator = original


__all__ = ["STATE_VERSION", "SeedableRandomSampler", "derive_seed", "epoch_seed", "lent_generator", "seeded_generator", "worker_seed"]
