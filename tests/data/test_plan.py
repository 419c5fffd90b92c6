"""The plan of a pass (torchrig.data.plan.index_parts, batch_parts) against the sharding rules written out
sample by sample: every order type (shuffled tensor, a strided view, list, range), one rank's slot or all of
them (dispatch), any start position, even/uneven, drop_last."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrig.data.plan import BatchMeta, Layout, batch_parts, index_parts


def rules(order: list[int], start: int, layout: Layout, slots: tuple[int, ...]) -> list[tuple[list[int], BatchMeta]]:
    """The rules of torchrig.data, one global batch at a time: global batch k holds positions
    ``[start + k*g, start + (k+1)*g)``, rank r the r-th run of b of them; a short final batch is
    dropped (drop_last), padded from the epoch's start (even) or cut (uneven: a rank past the
    data gets nothing)."""
    n, b, world = len(order), layout.per_rank, layout.world
    assert b is not None
    g = b * world
    rounds: list[list[list[int] | None]] = []
    pos = start
    while pos < n:
        real = min(g, n - pos)
        if real < g and layout.drop_last:
            break
        parts: list[list[int] | None] = []
        for slot in range(world):
            lo, hi = pos + slot * b, pos + (slot + 1) * b
            if real == g or layout.even:
                parts.append([order[p if p < n else (p - n) % n] for p in range(lo, hi)])
            else:
                parts.append([order[p] for p in range(lo, min(hi, n))] or None)
        rounds.append(parts)
        pos += g
    out = []
    samples = batches = 0
    for index, parts in enumerate(rounds):
        real = min(g, n - start - index * g)
        real_batches = math.ceil(real / b)
        samples, batches = samples + real, batches + real_batches
        nparts = sum(part is not None for part in parts)
        for slot in slots:
            part = parts[slot]
            if part is None:
                continue
            last = all(later[slot] is None for later in rounds[index + 1:])
            out.append((part, BatchMeta(index, real, real_batches, slot, nparts, samples, batches, last)))
    return out


@settings(max_examples=400, deadline=None)
@given(n=st.integers(0, 40), b=st.integers(1, 5), world=st.integers(1, 4), data=st.data(),
       even=st.booleans(), drop_last=st.booleans(), kind=st.sampled_from(["tensor", "view", "list", "range"]))
def test_the_plan_follows_the_sharding_rules(n, b, world, data, even, drop_last, kind):
    start = data.draw(st.integers(0, n), label="start")
    every = data.draw(st.booleans(), label="dispatch (every slot)")
    slots = tuple(range(world)) if every else (data.draw(st.integers(0, world - 1), label="rank"),)
    layout = Layout(world, slots[0], b, False, even and world > 1, drop_last)
    shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(n)) if kind != "range" else torch.arange(n)
    # "view": an order that is a strided view into a larger tensor (offset, not contiguous).
    order = {"tensor": shuffled, "view": torch.stack([shuffled + 100, shuffled], dim=1)[:, 1], "list": shuffled.tolist(),
             "range": range(n)}[kind]
    plan = index_parts(order, n, start, layout, slots)
    got = list(zip(plan.parts, plan.metas(), strict=True))
    assert got == rules(shuffled.tolist(), start, layout, slots)  # a part that is not a list (a range) fails here
    assert plan.count == len(got) and all(type(meta) is BatchMeta for _, meta in got)
    if len(slots) == 1:  # a counted pass's end-of-data test: the plan's last batch is the rank's last
        assert [meta.last for _, meta in got] == [k == plan.count - 1 for k in range(plan.count)]


def test_a_batch_split_batches_cannot_split_is_refused_before_the_pass_hands_out_any():
    batches = [[0, 1], [2, 3], [4, 5, 6], [7, 8]]
    with pytest.raises(ValueError, match=r"batch 2 of the batch sampler has 3 samples.*across 2 processes"):
        batch_parts(batches, 0, Layout(2, 0, None, True, True, False), (0,))
    plan = batch_parts(batches, 3, Layout(2, 1, None, True, True, False), (1,))  # resumed past it
    assert list(plan.parts) == [[8]] and plan.meta(0) == BatchMeta(0, 2, 1, 1, 2, 2, 1, True)
