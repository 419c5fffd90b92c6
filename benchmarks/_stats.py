"""Statistics the benchmarks share: interleaved rate measurements, medians with bootstrap confidence
intervals."""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any


def bootstrap_ci(values: list[float], rounds: int = 2000) -> tuple[float, float]:
    """95% bootstrap confidence interval of the median of ``values`` (fixed seed: reruns of the
    same numbers print the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds)]



def interleaved_rates(steppers: Sequence[tuple[str, Any]], rounds: int,
                      rate: Callable[[Any], float]) -> dict[str, Any]:
    """B13's procedure on built ``(side, stepper)`` pairs (sides ``"hand"`` and ``"rig"``): one
    warm-up each, then ``rounds`` rounds, every other one in reverse order, each side's rate the mean
    of its copies in a round; the median rate per side and the median and list of per-round ratios
    (rig ÷ hand)."""
    for _, step in steppers:  # warm up
        rate(step)
    rates: dict[str, list[float]] = {"hand": [], "rig": []}
    for index in range(rounds):
        this_round: dict[str, list[float]] = {"hand": [], "rig": []}
        for side, step in (steppers if index % 2 == 0 else steppers[::-1]):
            this_round[side].append(rate(step))
        for side, values in this_round.items():
            rates[side].append(statistics.fmean(values))
    ratios = [r / h for r, h in zip(rates["rig"], rates["hand"])]
    return {"hand": statistics.median(rates["hand"]), "rig": statistics.median(rates["rig"]),
            "ratio": statistics.median(ratios), "ratios": ratios}


def combine_trials(runs: Sequence[Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per rank, over trials (``runs[trial][rank]``, each from :func:`interleaved_rates`): both sides'
    mean rate, the geometric mean of the trials' median ratios, every trial's ratio and the pooled
    per-round ratios."""
    combined = []
    for per_trial in zip(*runs):
        combined.append({**per_trial[0], "hand": statistics.fmean(r["hand"] for r in per_trial),
                         "rig": statistics.fmean(r["rig"] for r in per_trial),
                         "ratio": math.exp(statistics.fmean(math.log(r["ratio"]) for r in per_trial)),
                         "trials": [r["ratio"] for r in per_trial],
                         "ratios": [x for r in per_trial for x in r["ratios"]]})
    return combined
