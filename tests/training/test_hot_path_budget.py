"""The hot path has a budget in calls, not seconds (issue 19).

Timing tests flake and hide small regressions in noise; a count of the Python-level calls
torchrig makes per batch and per step does neither. ``sys.setprofile`` sees every Python
function call and every call into C; each test counts those made from torchrig's own code (and,
for the loader, everything, against a plain DataLoader) over a steady-state epoch and fails when
the count grows. A change that must add work to the hot path raises the budget here, in the same
commit, saying why — so nobody puts it back silently. Benchmarks (benchmarks/, B1 and B11) say
what the calls cost.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchrig import Accelerator
from torchrig.data import shard_dataloader

TORCHRIG = str(Path(__import__("torchrig").__file__).parent)
BATCHES = 20
BATCH = 64

#: torchrig's Python calls per batch of a prepared map-style loader (one rank, a CPU run: nothing
#: to place): the plan's generator (which is the rebuilt loader's batch sampler) — the batches
#: reach the loop through C iterators only; plus about 25 calls per pass (setting it up and
#: closing it), spread over its 20 batches.
LOADER_TORCHRIG_CALLS = 2
#: Everything (Python and C calls, torch's DataLoader included) per batch of 64, over a plain
#: DataLoader with a shuffled RandomSampler: the prepared loader lists each epoch's order once
#: (one ``tolist`` per epoch, a list slice per batch) instead of calling the sampler per index,
#: so it makes about 60 fewer calls (torch 2.13); it must stay at least this many below.
LOADER_EXTRA_CALLS_OVER_PLAIN = -58
#: torchrig's Python calls per training step through the Accelerator (backward, optimizer step,
#: zero_grad: the prepared wrappers and the step plan's plain callables), data excluded.
STEP_TORCHRIG_CALLS = 6


def _dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(BATCH * BATCHES, 8, generator=generator), torch.arange(BATCH * BATCHES))


def _count(run: Callable[[], None]) -> tuple[collections.Counter, int]:
    """(torchrig's Python calls by function, all calls) made by ``run()``."""
    ours: collections.Counter = collections.Counter()
    total = 0

    def profile(frame, event, arg):
        nonlocal total
        if event == "call":
            total += 1
            if frame.f_code.co_filename.startswith(TORCHRIG):
                ours[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            total += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return ours, total


def _epoch(loader) -> Callable[[], None]:
    def run() -> None:
        for _ in loader:
            pass

    return run


def _per_batch(counter: collections.Counter) -> dict[str, float]:
    return {name: count / BATCHES for name, count in sorted(counter.items())}


def test_a_prepared_loader_makes_a_fixed_number_of_torchrig_calls_per_batch():
    loader = shard_dataloader(DataLoader(_dataset(), batch_size=BATCH, shuffle=True), 1, 0, seed=3)
    loader.device = torch.device("cpu")  # as prepare() does on a CPU run
    _epoch(loader)()  # the first pass builds the rebuilt loader: not the steady state
    ours, _ = _count(_epoch(loader))
    per_batch = sum(ours.values()) / BATCHES
    assert per_batch <= LOADER_TORCHRIG_CALLS + 0.5, (
        f"the prepared loader now makes {per_batch:.1f} torchrig calls per batch (budget "
        f"{LOADER_TORCHRIG_CALLS}): {_per_batch(ours)}")
    assert per_batch >= LOADER_TORCHRIG_CALLS - 1, (
        f"{per_batch:.1f} calls per batch: lower the budget to keep it tight ({_per_batch(ours)})")


def test_a_prepared_loader_calls_no_more_than_a_plain_shuffled_dataloader():
    plain = DataLoader(_dataset(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(3))
    loader = shard_dataloader(DataLoader(_dataset(), batch_size=BATCH, shuffle=True), 1, 0, seed=3)
    loader.device = torch.device("cpu")
    for warm in (plain, loader):
        _epoch(warm)()
    _, plain_calls = _count(_epoch(plain))
    ours, prepared_calls = _count(_epoch(loader))
    extra = (prepared_calls - plain_calls) / BATCHES
    assert extra <= LOADER_EXTRA_CALLS_OVER_PLAIN, (
        f"the prepared loader makes {extra:+.1f} calls per batch over a plain DataLoader (budget "
        f"{LOADER_EXTRA_CALLS_OVER_PLAIN:+d}); torchrig's: {_per_batch(ours)}")
    assert extra >= LOADER_EXTRA_CALLS_OVER_PLAIN - 10, f"{extra:+.1f}: lower the budget to keep it tight"


def test_a_training_step_through_the_accelerator_makes_a_fixed_number_of_torchrig_calls():
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = [(x, y % 4) for x, y in DataLoader(_dataset(), batch_size=BATCH)]

    def steps() -> None:
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()

    steps()  # first steps build the step plan
    ours, _ = _count(steps)
    per_step = sum(ours.values()) / BATCHES
    assert per_step <= STEP_TORCHRIG_CALLS, (
        f"a step through the Accelerator now makes {per_step:.1f} torchrig calls (budget "
        f"{STEP_TORCHRIG_CALLS}): {_per_batch(ours)}")
    assert per_step >= STEP_TORCHRIG_CALLS - 1, f"lower the budget to keep it tight: {_per_batch(ours)}"


@pytest.mark.parametrize("budget", [LOADER_TORCHRIG_CALLS, STEP_TORCHRIG_CALLS])
def test_budgets_are_small_numbers(budget):
    """A budget that grew past a few dozen calls has stopped guarding anything."""
    assert 0 < budget <= 24
