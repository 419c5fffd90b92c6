"""What ``torchrig plan`` prints: each planned rank's layout, memory at the step's peak, collectives per
mesh axis and the step-time estimate on the target GPU and network; every error, by rank.

Torch-free arithmetic and formatting over the engine's records (:mod:`torchrig.estimate.plan` makes
them); the step time is :func:`torchrig.estimate.step_time.estimate_step_time` of a rank's recording.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchrig.estimate.costs import CollectiveSummary
from torchrig.estimate.hardware import GpuSpec, Interconnect
from torchrig.estimate.memory import format_bytes
from torchrig.estimate.step_time import Pipeline, StepTimeEstimate, estimate_step_time, peak_precision

if TYPE_CHECKING:  # the engine's types; this module formats them without importing torch
    from torchrig.estimate.plan import PlanReport, RankPlan

#: Axes whose ranks hold replicas of the same batch's work (tokens per GPU divide by them).
_SHARING_AXES = ("tp", "cp", "pp")
#: The memory categories, in the order printed.
_CATEGORIES = ("parameters", "gradients", "optimizer_state", "buffers", "activations", "temporaries")


def _pipeline(plan: RankPlan, microbatches: int | None) -> Pipeline | None:
    stages = plan.layout.mesh.get("pp", 1) if plan.layout else 1
    if stages <= 1:
        return None
    return Pipeline(stages=stages, microbatches=microbatches or stages)


def step_time(plan: RankPlan, report: PlanReport, gpu: GpuSpec, network: Interconnect) -> StepTimeEstimate | None:
    """The roofline of one planned rank's recorded step on ``gpu`` and ``network`` (None without a step)."""
    if plan.step is None or plan.layout is None:
        return None
    recording = plan.step
    sharing = 1
    for axis in _SHARING_AXES:
        sharing *= plan.layout.mesh.get(axis, 1)
    flops = sum(recording.flops.values())
    return estimate_step_time(
        ops=recording.ops, collectives=recording.collectives, gpu=gpu, interconnect=network,
        axes_across_nodes=recording.axes_across_nodes, precision=peak_precision(plan.layout.mixed_precision),
        gpus_per_node=report.target.processes_per_machine, pipeline=_pipeline(plan, None),
        tokens_per_step=recording.tokens / sharing, model_flops_per_step=flops)


def _memory_line(plan: RankPlan, gpu: GpuSpec) -> str:
    memory = plan.step.memory
    parts = ", ".join(f"{name.replace('_', ' ')} {format_bytes(memory.by_category.get(name, 0))}"
                      for name in _CATEGORIES if memory.by_category.get(name, 0))
    free = gpu.memory_bytes - memory.peak_bytes
    verdict = (f"{format_bytes(free)} of {format_bytes(gpu.memory_bytes)} left on a {gpu.name}" if free >= 0 else
               f"DOES NOT FIT: {format_bytes(-free)} over the {format_bytes(gpu.memory_bytes)} of a {gpu.name}")
    return f"  memory at the peak ({memory.peak_phase}): {format_bytes(memory.peak_bytes)} = {parts}; {verdict}"


def _collective_lines(collectives: tuple[CollectiveSummary, ...], across: dict[str, bool]) -> list[str]:
    lines = [f"  {'axis':<14}{'kind':<16}{'ranks':>6}{'count':>7}{'payload':>12}{'sent by rank':>14}  link"]
    for item in collectives:
        link = "between machines" if across.get(item.axis) else "within a machine"
        lines.append(f"  {item.axis:<14}{item.kind:<16}{item.group_size:>6}{item.count:>7}"
                     f"{format_bytes(item.payload_bytes):>12}{format_bytes(item.wire_bytes):>14}  {link}")
    return lines


def _time_lines(estimate: StepTimeEstimate) -> list[str]:
    comm = ", ".join(f"{axis} {seconds * 1e3:.1f} ms" for axis, seconds in estimate.comm_s.items())
    line = (f"  step time on {estimate.gpu} ({estimate.precision}): {estimate.total_s * 1e3:.1f} ms = compute "
            f"{estimate.compute_s * 1e3:.1f} ms + exposed communication {estimate.exposed_comm_s * 1e3:.1f} ms")
    if estimate.bubble_s:
        line += f" + pipeline bubble {estimate.bubble_s * 1e3:.1f} ms"
    lines = [line, f"  communication (overlapped or not): {comm or 'none'}"]
    if estimate.tokens_per_s is not None and estimate.mfu is not None:
        lines.append(f"  {estimate.tokens_per_s:,.0f} tokens/s per GPU, MFU {estimate.mfu:.1%}")
    return lines


def overflows(report: PlanReport, gpu: GpuSpec) -> list[str]:
    """The planned ranks whose step's peak exceeds the GPU's memory: the run would fail there too."""
    return [f"rank {plan.rank}: the step's peak ({plan.step.memory.peak_phase}) needs "
            f"{format_bytes(plan.step.memory.peak_bytes)}, a {gpu.name} has {format_bytes(gpu.memory_bytes)}"
            for plan in report.ranks if plan.step is not None and plan.step.memory.peak_bytes > gpu.memory_bytes]


def failures(report: PlanReport, gpu: GpuSpec) -> list[str]:
    """Everything that would make the planned run fail: the errors its ranks raise, and memory it lacks."""
    return report.errors + overflows(report, gpu)


def format_plan(report: PlanReport, gpu: GpuSpec, network: Interconnect) -> str:
    """The terminal report: a header, one block per planned rank, the assumptions, the errors."""
    target, inputs = report.target, report.inputs
    out = [f"torchrig plan: {inputs.model} on {target.num_machines} machine(s) × {target.processes_per_machine} "
           f"= {target.world_size} ranks; {gpu.name}, {network.name} between machines; micro-batch "
           f"{inputs.batch_size} × {inputs.seq_len} tokens, {inputs.optimizer}"]
    assumptions: list[str] = []
    for plan in report.ranks:
        out.append("")
        if plan.error:
            out.append(f"rank {plan.rank}: FAILS at {plan.error}")
            continue
        if plan.layout is None:
            out.append(f"rank {plan.rank}: not planned: {plan.unsupported}")
            continue
        layout = plan.layout
        mesh = " × ".join(f"{name} {size}" for name, size in layout.mesh.items()) or "no mesh"
        out.append(f"rank {plan.rank} ({layout.role}; {mesh}; strategy {layout.strategy}, {layout.mixed_precision}): "
                   f"{layout.local_parameters:,} of {layout.total_parameters:,} parameters")
        if plan.step is None:
            if plan.unsupported:
                out.append(f"  step not planned: {plan.unsupported}")
            continue
        out.append(_memory_line(plan, gpu))
        out.extend(_collective_lines(plan.step.collectives, plan.step.axes_across_nodes))
        estimate = step_time(plan, report, gpu, network)
        if estimate is not None:
            out.extend(_time_lines(estimate))
            assumptions = estimate.describe_assumptions()
    if assumptions:
        out += ["", "assumptions of the step time:"] + [f"  - {line}" for line in assumptions]
    errors = failures(report, gpu)
    partial = [plan.rank for plan in report.ranks if plan.unsupported]
    if errors:
        verdict = f"{len(errors)} error(s): the run would fail"
    elif partial:
        verdict = (f"no errors found, but rank(s) {', '.join(map(str, partial))} could not be planned whole here "
                   "(see above)")
    else:
        verdict = "no errors: every planned rank prepared and stepped, and fits"
    out += ["", verdict]
    out += [f"  - {error}" for error in errors]
    return "\n".join(out) + "\n"


def _rank_dict(plan: RankPlan, report: PlanReport, gpu: GpuSpec, network: Interconnect) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": plan.rank, "error": plan.error, "unsupported": plan.unsupported,
                             "seconds": plan.seconds}
    if plan.layout is not None:
        layout = plan.layout
        entry["layout"] = {"role": layout.role, "mesh": layout.mesh, "coordinates": layout.coordinates,
                           "strategy": layout.strategy, "mixed_precision": layout.mixed_precision,
                           "local_parameters": layout.local_parameters, "total_parameters": layout.total_parameters,
                           "parameter_bytes": layout.parameter_bytes}
    if plan.step is not None:
        recording = plan.step
        entry["memory"] = recording.memory.as_dict()
        entry["memory"]["fits"] = recording.memory.peak_bytes <= gpu.memory_bytes
        entry["collectives"] = [item.as_dict() for item in recording.collectives]
        entry["flops"] = recording.flops
        entry["axes_across_nodes"] = recording.axes_across_nodes
        estimate = step_time(plan, report, gpu, network)
        entry["step_time"] = estimate.as_dict() if estimate is not None else None
    return entry


def plan_as_dict(report: PlanReport, gpu: GpuSpec, network: Interconnect) -> dict[str, Any]:
    """``--json``: the same report as data."""
    target, inputs = report.target, report.inputs
    return {"model": inputs.model, "target": {"num_machines": target.num_machines,
                                              "processes_per_machine": target.processes_per_machine,
                                              "world_size": target.world_size, "gpu": gpu.as_dict(),
                                              "interconnect": network.as_dict()},
            "batch_size": inputs.batch_size, "seq_len": inputs.seq_len, "optimizer": inputs.optimizer,
            "ranks": [_rank_dict(plan, report, gpu, network) for plan in report.ranks],
            "errors": failures(report, gpu)}


__all__ = ["failures", "format_plan", "overflows", "plan_as_dict", "step_time"]
