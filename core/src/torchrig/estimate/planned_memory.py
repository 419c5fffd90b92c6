"""``torchrig estimate-memory``'s numbers, from the plan's recorded step: the project's one model of
training memory (docs/estimate-memory.md).

A strategy the plan can run (the single process, DDP, FSDP2 and every N-D mesh) is sized by what one
planned training step holds at its peak on the largest planned rank (:mod:`torchrig.estimate.plan`:
the real strategy in a fake world, the step recorded under ``FakeTensorMode``) — pipeline stages,
tensor/sequence parallel shards, activation checkpointing and the strategy's own buffers included,
because they are what the step allocates. A strategy whose engine cannot be planned
(``PlanningUnsupported``: DeepSpeed) answers ``torchrig_estimate_memory`` from its manifest instead.
Torch-free: it reads the engine's records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrig.estimate.memory import MemoryComponent, MemoryEstimate

if TYPE_CHECKING:  # the engine's types; read here without importing torch
    from torchrig.estimate.plan import PlanReport

#: category of the recorded step -> (the estimate's line, what it holds)
LINES = {
    "parameters": ("parameters", "this rank's parameters as prepared (its shards under FSDP2/TP/PP)"),
    "gradients": ("gradients", "held at the peak"),
    "optimizer_state": ("optimizer state", "this rank's optimizer state"),
    "buffers": ("buffers", "the model's buffers"),
    "activations": ("activations", "saved for backward at the peak (micro-batches in flight under PP)"),
    "temporaries": ("temporaries", "all-gathered parameters, communication buffers and kernels' workspaces"),
}
#: What ``--no_activations`` leaves out: what depends on the batch.
BATCH_DEPENDENT = ("activations", "temporaries")


def recorded_estimate(report: PlanReport, *, no_activations: bool = False) -> MemoryEstimate | None:
    """The estimate of the planned rank whose step peaks highest; ``None`` when no rank's step was
    recorded (the strategy cannot be planned, or every rank failed: the report says which)."""
    planned = [plan for plan in report.ranks if plan.step is not None and plan.layout is not None]
    if not planned:
        return None
    worst = max(planned, key=lambda plan: plan.step.memory.peak_bytes)  # type: ignore[union-attr]
    assert worst.step is not None and worst.layout is not None
    memory, layout = worst.step.memory, worst.layout
    components = tuple(MemoryComponent(LINES[category][0], nbytes, note=LINES[category][1])
                       for category, nbytes in memory.by_category.items()
                       if nbytes and not (no_activations and category in BATCH_DEPENDENT))
    mesh = " × ".join(f"{axis} {size}" for axis, size in layout.mesh.items())
    label = f"{layout.strategy} ({mesh})" if mesh else layout.strategy
    world = report.target.world_size
    notes = [f"recorded from one planned training step of rank {worst.rank} ({layout.role}) at its peak, in "
             f"{memory.peak_phase}: the real strategy in a fake world of {world} (torchrig plan, docs/plan.md)"]
    if len(planned) > 1:
        notes.append("ranks planned: " + ", ".join(
            f"{plan.rank} ({plan.layout.role if plan.layout else '?'})" for plan in planned) + "; the largest shown")
    if no_activations:
        notes.append("--no_activations: activations and temporaries left out (what depends on the batch)")
    return MemoryEstimate(strategy=layout.strategy, label=label, world_size=world, precision=layout.mixed_precision,
                          components=components, notes=tuple(notes))


__all__ = ["BATCH_DEPENDENT", "LINES", "recorded_estimate"]
