"""Statistics the benchmarks share: medians with bootstrap confidence intervals."""

from __future__ import annotations

import random
import statistics


def bootstrap_ci(values: list[float], rounds: int = 2000) -> tuple[float, float]:
    """95% bootstrap confidence interval of the median of ``values`` (fixed seed: reruns of the
    same numbers print the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds)]

