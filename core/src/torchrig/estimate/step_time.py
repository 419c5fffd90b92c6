"""The step-time roofline: what one optimizer step of one rank costs on a GPU kind and network, from the
operator costs and collectives ``torchrig plan`` records (:mod:`torchrig.estimate.costs`).

Why a roofline and not a simulator: the recorded step says how many FLOPs and bytes each operator moves
and which collectives run on which mesh axis; a bound per operator (compute or memory, whichever is
slower) and per collective (latency + bytes over the link it crosses), combined under *stated* overlap
assumptions, is accurate to the degree those assumptions hold and says what it assumed
(:meth:`StepTimeEstimate.describe_assumptions`, printed by the CLI). Torch-free.

Per operator: ``count · max(flops / (peak[dtype] · matmul_efficiency), bytes / (hbm · memory_efficiency))``.
Per collective: ``count · (base + steps · hop) + wire_bytes / bandwidth``, NCCL's ring model: ``steps`` =
n-1 for all-gather/reduce-scatter/all-to-all, 2(n-1) for all-reduce, n for the rest; the bandwidth is the
GPU's intra-node link when every group of the axis lies inside one node, else the interconnect's share
per GPU (:func:`axes_spanning_nodes`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from torchrig.estimate.costs import COLLECTIVE_KINDS, CollectiveRecord, CollectiveSummary, OpCost
from torchrig.estimate.hardware import COLLECTIVE_BASE_S, PRECISIONS, GpuSpec, Interconnect

#: The precision column a recorded operator dtype computes in (``float32`` maps to ``fp32`` or, when
#: the run allows TF32 matmuls, ``tf32``).
DTYPE_PRECISIONS = {"float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "float8_e4m3fnuz": "fp8", "float8_e5m2fnuz": "fp8",
                    "fp8": "fp8", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "half": "fp16",
                    "fp16": "fp16", "float32": "fp32", "float": "fp32", "fp32": "fp32", "tf32": "tf32"}

#: The mesh axes whose collectives are FSDP's/DDP's parameter and gradient traffic (prefetched and
#: overlapped with compute), as ParallelDims names them and their flattenings; ``efsdp`` is what is left of
#: ``dp_shard`` once expert parallelism borrows ``ep`` from it (torchtitan's name), the experts' FSDP2 axis.
DATA_AXES = ("dp", "dp_shard", "dp_replicate", "dp_shard_cp", "dp_cp", "efsdp", "world")

PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
#: The phases of a step, in order (:class:`~torchrig.estimate.costs.CollectiveRecord`'s ``phase``).
PHASES = ("forward", "backward", "other", "optimizer")


@attrs.frozen
class OverlapAssumptions:
    """What the estimate assumes about overlap and achievable rates; each default with its reason.

    * ``overlap_data_collectives``: FSDP2 prefetches the next unit's all-gather during the current
      unit's compute and reduce-scatters a unit's gradients during the next unit's backward (Zhao et
      al. 2023, "PyTorch FSDP", VLDB, §3.3), DDP all-reduces buckets during backward — so collectives on
      the ``data_axes`` hide behind compute, except the step's first all-gather and last
      reduce-scatter/all-reduce, which have no compute to hide behind, and except what exceeds the compute.
    * TP/SP/CP/EP/PP collectives are exposed: each output is needed by the very next operator
      (Megatron-LM's TP, Shoeybi et al. 2019); AsyncTP's overlap is not modelled.
    * optimizer-phase collectives (gradient-norm all-reduce, DeepSpeed's parameter gathers) are exposed:
      the optimizer step waits for them.
    * ``matmul_efficiency`` 0.75: large dense GEMMs reach roughly 70-80% of a datasheet's dense peak on
      Hopper/Ampere; no single source — an assumption the lent-GPU calibration (benchmarks B7/B16) checks.
    * ``memory_efficiency`` 0.8: streaming kernels reach roughly 80-90% of datasheet HBM bandwidth
      (STREAM-style copy benchmarks); an assumption.
    * pipeline bubble: ``(pp-1)/(v·m + pp-1)`` of the pipelined time for GPipe/1F1B (v=1) and interleaved
      1F1B with v virtual stages per rank (Narayanan et al. 2021, "Efficient Large-Scale Language Model
      Training on GPU Clusters", §2.2).
    """

    overlap_data_collectives: bool = True
    data_axes: tuple[str, ...] = DATA_AXES
    matmul_efficiency: float = attrs.field(default=0.75)
    memory_efficiency: float = attrs.field(default=0.8)

    @matmul_efficiency.validator
    @memory_efficiency.validator
    def _fraction(self, attribute: attrs.Attribute, value: float) -> None:
        if not 0 < value <= 1:
            raise ValueError(f"OverlapAssumptions.{attribute.name} must be in (0, 1], got {value!r}")


@attrs.frozen
class Pipeline:
    """The pipeline shape the bubble follows: ``stages`` (pp degree), ``microbatches`` per step and
    ``virtual_stages`` per rank (interleaved schedules)."""

    stages: int = 1
    microbatches: int = 1
    virtual_stages: int = 1
    schedule: str = "1f1b"

    def __attrs_post_init__(self) -> None:
        for name in ("stages", "microbatches", "virtual_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"Pipeline.{name} must be >= 1, got {getattr(self, name)}")
        if self.schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {self.schedule!r}; known: {', '.join(PIPELINE_SCHEDULES)}")
        if self.virtual_stages > 1 and self.schedule != "interleaved-1f1b":
            raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule 'interleaved-1f1b', "
                             f"got {self.schedule!r}")

    @property
    def bubble_fraction(self) -> float:
        """Share of the pipelined time spent idle: (pp-1)/(v·m + pp-1)."""
        idle = self.stages - 1
        return idle / (self.virtual_stages * self.microbatches + idle)


def axes_spanning_nodes(mesh_shape: Sequence[int], dim_names: Sequence[str], gpus_per_node: int,
                        flattened: Mapping[str, Sequence[str]] | None = None) -> dict[str, bool]:
    """For each mesh axis (and each flattened axis of ``flattened``, e.g. ``{"dp": ("dp_replicate",
    "dp_shard")}``, and ``"world"``): whether its groups span nodes. The mesh is row-major over global
    ranks, as torch's ``DeviceMesh`` lays it out, with ranks ``k·gpus_per_node ..`` on node ``k``; an
    axis is intra-node when every group's ranks share a node."""
    shape = tuple(mesh_shape)
    if len(shape) != len(dim_names):
        raise ValueError(f"mesh_shape {shape} and dim_names {tuple(dim_names)} differ in length")
    if gpus_per_node < 1 or any(size < 1 for size in shape):
        raise ValueError(f"mesh sizes and gpus_per_node must be >= 1, got {shape} and {gpus_per_node}")
    world = math.prod(shape)
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    index = {name: i for i, name in enumerate(dim_names)}

    def spans(dims: Sequence[int]) -> bool:
        """Whether any group varying over ``dims`` (others fixed) holds ranks of two nodes."""
        offsets = [0]
        for dim in dims:
            offsets = [offset + k * strides[dim] for offset in offsets for k in range(shape[dim])]
        fixed = [i for i in range(len(shape)) if i not in dims]
        bases = [0]
        for dim in fixed:
            bases = [base + k * strides[dim] for base in bases for k in range(shape[dim])]
        return any(len({(base + offset) // gpus_per_node for offset in offsets}) > 1 for base in bases)

    placement = {name: spans([index[name]]) for name in dim_names}
    for name, members in (flattened or {}).items():
        unknown = [member for member in members if member not in index]
        if unknown:
            raise ValueError(f"flattened axis {name!r} names {unknown}, not axes of the mesh {tuple(dim_names)}")
        placement[name] = spans(sorted(index[member] for member in members))
    placement["world"] = world > gpus_per_node
    return placement


def _ring_steps(kind: str, group_size: int) -> int:
    """NCCL's ring step count per collective (src/graph/tuning.cc: nsteps)."""
    if group_size <= 1:
        return 0
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return group_size - 1
    if kind == "all_reduce":
        return 2 * (group_size - 1)
    if kind in ("send", "recv"):
        return 1
    return group_size


@attrs.frozen
class CollectiveTime:
    """The collectives of one kind on one axis in one phase, timed."""

    axis: str
    kind: str
    phase: str
    group_size: int
    count: int
    wire_bytes: int
    across_nodes: bool
    seconds: float
    exposed_s: float  # the part no compute hides (before the overlap cap on the rest)
    overlappable_s: float

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class StepTimeEstimate:
    """One rank's optimizer step on a GPU kind: compute, communication per axis, what of it is exposed,
    the pipeline bubble and the total; tokens/s and MFU when the step's tokens and model FLOPs are known."""

    compute_s: float
    flops_bound_s: float
    memory_bound_s: float
    comm_s: Mapping[str, float]
    exposed_comm_s: float
    bubble_s: float
    total_s: float
    collectives: tuple[CollectiveTime, ...]
    gpu: str
    precision: str
    peak_flops: float
    tokens_per_step: float | None = None
    model_flops_per_step: float | None = None
    assumptions: tuple[str, ...] = ()

    @property
    def tokens_per_s(self) -> float | None:
        """Tokens this rank processes per second (per GPU)."""
        return None if self.tokens_per_step is None else self.tokens_per_step / self.total_s

    @property
    def mfu(self) -> float | None:
        """Model FLOPs per second ÷ this GPU's dense peak in the run's precision."""
        if self.model_flops_per_step is None:
            return None
        return self.model_flops_per_step / self.total_s / self.peak_flops

    def describe_assumptions(self) -> list[str]:
        """One line per assumption behind the numbers, for the CLI to print beside them."""
        return list(self.assumptions)

    def as_dict(self) -> dict[str, Any]:
        return {"compute_s": self.compute_s, "flops_bound_s": self.flops_bound_s,
                "memory_bound_s": self.memory_bound_s, "comm_s": dict(self.comm_s),
                "exposed_comm_s": self.exposed_comm_s, "bubble_s": self.bubble_s, "total_s": self.total_s,
                "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s,
                "model_flops_per_step": self.model_flops_per_step, "mfu": self.mfu, "gpu": self.gpu,
                "precision": self.precision, "peak_flops": self.peak_flops,
                "collectives": [c.as_dict() for c in self.collectives], "assumptions": list(self.assumptions)}


#: The peak column a run's ``mixed_precision`` is measured against (fp8 runs: the fp8 column; torchtitan and
#: benchmarks/bench_fp8.py also quote them against bf16).
MIXED_PRECISION_PEAKS = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8", "no": "fp32"}


def peak_precision(mixed_precision: str, tf32: bool = False) -> str:
    """The peak column for a ``mixed_precision`` value (``no`` → fp32, or tf32 when the run allows TF32)."""
    if mixed_precision not in MIXED_PRECISION_PEAKS:
        raise ValueError(f"unknown mixed_precision {mixed_precision!r}; known: {', '.join(MIXED_PRECISION_PEAKS)}")
    column = MIXED_PRECISION_PEAKS[mixed_precision]
    return "tf32" if column == "fp32" and tf32 else column


def op_precision(dtype: str, tf32: bool = False) -> str:
    """The peak-table column an operator of ``dtype`` computes in."""
    name = dtype.removeprefix("torch.")
    if name not in DTYPE_PRECISIONS:
        raise ValueError(f"no peak rate for operator dtype {dtype!r}; known: {', '.join(sorted(DTYPE_PRECISIONS))}")
    precision = DTYPE_PRECISIONS[name]
    return "tf32" if precision == "fp32" and tf32 else precision


def op_seconds(op: OpCost, gpu: GpuSpec, assumptions: OverlapAssumptions, tf32: bool = False) -> tuple[float, bool]:
    """(seconds, flops-bound?) of an operator: the slower of its compute and its memory traffic."""
    memory = op.bytes / (gpu.hbm_bytes_per_s * assumptions.memory_efficiency)
    compute = 0.0
    if op.flops:
        try:
            peak = gpu.peak_flops_for(op_precision(op.dtype, tf32))
        except ValueError as error:
            raise ValueError(f"operator {op.name!r}: {error}") from None
        compute = op.flops / (peak * assumptions.matmul_efficiency)
    return op.count * max(compute, memory), compute >= memory and compute > 0


def collective_seconds(kind: str, group_size: int, count: int, wire_bytes: float, bandwidth: float,
                       hop_latency_s: float) -> float:
    """``count`` collectives moving ``wire_bytes`` in all: NCCL's base latency and one hop per ring step
    each, plus the bytes over ``bandwidth`` (bytes/s per GPU per direction)."""
    if group_size <= 1:
        return 0.0
    latency = count * (COLLECTIVE_BASE_S + _ring_steps(kind, group_size) * hop_latency_s)
    return latency + wire_bytes / bandwidth


def _grouping_order(key: tuple[str, str, str, int]) -> tuple[str, str, int, int]:
    """Axis, kind, then the phases in step order: the first unhidden collective is the earliest."""
    axis, kind, phase, size = key
    return axis, kind, PHASES.index(phase), size


def _grouped(collectives: Iterable[CollectiveRecord | CollectiveSummary]) -> list[tuple[str, str, str, int, int, int]]:
    """(axis, kind, phase, group size, count, wire bytes) per distinct collective, in step order; summaries
    carry no phase (``"other"``). An unknown kind or phase is an error naming it."""
    totals: dict[tuple[str, str, str, int], list[int]] = {}
    for item in collectives:
        phase = item.phase if isinstance(item, CollectiveRecord) else "other"
        if item.kind not in COLLECTIVE_KINDS:
            raise ValueError(f"collective kind {item.kind!r} on axis {item.axis!r} is unknown; known: "
                             f"{', '.join(COLLECTIVE_KINDS)}")
        if phase not in PHASES:
            raise ValueError(f"collective {item.kind!r} on axis {item.axis!r} has phase {phase!r}; known: "
                             f"{', '.join(PHASES)}")
        count = item.count if isinstance(item, CollectiveSummary) else 1
        entry = totals.setdefault((item.axis, item.kind, phase, item.group_size), [0, 0])
        entry[0] += count
        entry[1] += item.wire_bytes
    return [(*key, *totals[key]) for key in sorted(totals, key=_grouping_order)]


def estimate_step_time(*, ops: Iterable[OpCost], collectives: Iterable[CollectiveRecord | CollectiveSummary],
                       gpu: GpuSpec, interconnect: Interconnect, axes_across_nodes: Mapping[str, bool],
                       precision: str = "bf16", gpus_per_node: int = 8, tf32: bool = False,
                       assumptions: OverlapAssumptions | None = None, pipeline: Pipeline | None = None,
                       tokens_per_step: float | None = None,
                       model_flops_per_step: float | None = None) -> StepTimeEstimate:
    """The roofline of one rank's step (module docstring). ``ops`` and ``collectives`` are this rank's,
    for a whole optimizer step (all micro-batches); ``axes_across_nodes`` places every axis a collective
    names (:func:`axes_spanning_nodes`) — an axis it does not place is an error, not a guess.
    ``precision`` is the peak MFU is measured against; ``tokens_per_step`` and ``model_flops_per_step``
    are this rank's (÷ the ranks that share a batch), for tokens/s per GPU and MFU."""
    assumptions = assumptions or OverlapAssumptions()
    pipeline = pipeline or Pipeline()
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not a peak column ({', '.join(PRECISIONS)}); map a "
                         "mixed_precision value with peak_precision()")
    peak = gpu.peak_flops_for(precision)
    flops_bound = memory_bound = 0.0
    for op in ops:
        seconds, is_flops_bound = op_seconds(op, gpu, assumptions, tf32)
        if is_flops_bound:
            flops_bound += seconds
        else:
            memory_bound += seconds
    compute = flops_bound + memory_bound

    inter_bandwidth = interconnect.bytes_per_s_per_gpu(gpus_per_node)
    timed: list[CollectiveTime] = []
    charged: set[tuple[str, str]] = set()  # (axis, kind) whose one unhidden collective is counted
    for axis, kind, phase, size, count, wire in _grouped(collectives):
        if axis not in axes_across_nodes:
            raise ValueError(f"collective {kind!r} on axis {axis!r}: the axis is not placed (axes_across_nodes "
                             f"has {', '.join(sorted(axes_across_nodes)) or 'nothing'}); say whether it spans nodes")
        across = axes_across_nodes[axis]
        bandwidth, hop = ((inter_bandwidth, interconnect.hop_latency_s) if across
                          else (gpu.link_bytes_per_s, gpu.link_hop_latency_s))
        seconds = collective_seconds(kind, size, count, wire, bandwidth, hop)
        hidden_kind = kind in ("all_gather", "reduce_scatter", "all_reduce")
        if (assumptions.overlap_data_collectives and axis in assumptions.data_axes and phase != "optimizer"
                and hidden_kind and count > 0):
            # one per step stays exposed: the first all-gather, the last reduce-scatter or all-reduce
            exposed = 0.0 if (axis, kind) in charged else seconds / count
            charged.add((axis, kind))
        else:
            exposed = seconds
        timed.append(CollectiveTime(axis=axis, kind=kind, phase=phase, group_size=size, count=count,
                                    wire_bytes=wire, across_nodes=across, seconds=seconds, exposed_s=exposed,
                                    overlappable_s=seconds - exposed))

    comm_by_axis: dict[str, float] = {}
    for item in timed:
        comm_by_axis[item.axis] = comm_by_axis.get(item.axis, 0.0) + item.seconds
    overlappable = sum(item.overlappable_s for item in timed)
    always_exposed_data = sum(item.exposed_s for item in timed if item.axis in assumptions.data_axes)
    always_exposed_other = sum(item.exposed_s for item in timed if item.axis not in assumptions.data_axes)
    exposed = always_exposed_data + always_exposed_other + max(0.0, overlappable - compute)
    # the bubble idles a stage for (pp-1) micro-batch slots of its pipelined work: compute and the
    # per-micro-batch collectives (TP/SP/CP/PP); FSDP's traffic is per step, not pipelined
    pipelined = compute + always_exposed_other
    bubble = pipelined * (pipeline.stages - 1) / (pipeline.virtual_stages * pipeline.microbatches)
    total = compute + exposed + bubble
    lines = _describe(gpu, interconnect, precision, peak, gpus_per_node, assumptions, pipeline, tf32)
    return StepTimeEstimate(compute_s=compute, flops_bound_s=flops_bound, memory_bound_s=memory_bound,
                            comm_s=comm_by_axis, exposed_comm_s=exposed, bubble_s=bubble, total_s=total,
                            collectives=tuple(timed), gpu=gpu.name, precision=precision, peak_flops=peak,
                            tokens_per_step=tokens_per_step, model_flops_per_step=model_flops_per_step,
                            assumptions=tuple(lines))


def _describe(gpu: GpuSpec, interconnect: Interconnect, precision: str, peak: float, gpus_per_node: int,
              assumptions: OverlapAssumptions, pipeline: Pipeline, tf32: bool) -> list[str]:
    peaks = ", ".join(f"{name} {value / 1e12:g}" for name, value in gpu.peak_flops.items())
    lines = [
        f"GPU {gpu.name}: dense peak TFLOP/s {peaks}; HBM {gpu.hbm_bytes_per_s / 1e9:g} GB/s; "
        f"{gpu.link_name} {gpu.link_bytes_per_s / 1e9:g} GB/s per GPU each way (source: {gpu.source})",
        f"inter-node: {interconnect.name}, {interconnect.bytes_per_s_per_gpu(gpus_per_node) / 1e9:g} GB/s per GPU "
        f"each way with {gpus_per_node} GPUs per node (source: {interconnect.source})",
        f"operators run at {assumptions.matmul_efficiency:.0%} of the dense peak of their dtype "
        f"(float32 matmuls as {'tf32' if tf32 else 'fp32'}) or {assumptions.memory_efficiency:.0%} of HBM bandwidth, "
        "whichever is slower (large GEMMs reach ~70-80% of peak, streaming kernels ~80-90% of HBM; assumptions)",
        f"collectives: NCCL's ring model, {COLLECTIVE_BASE_S * 1e6:g} us per collective + {gpu.link_hop_latency_s * 1e6:g}"
        f" us (intra-node) / {interconnect.hop_latency_s * 1e6:g} us (inter-node) per ring step, plus wire bytes over the"
        " link the axis crosses (NVIDIA/nccl src/graph/tuning.cc); an axis spanning nodes runs at the interconnect's rate",
    ]
    if assumptions.overlap_data_collectives:
        lines.append(f"collectives on the data axes ({', '.join(assumptions.data_axes)}) overlap with compute "
                     "(FSDP prefetch, DDP buckets) except the step's first all-gather and last reduce-scatter/"
                     "all-reduce and whatever exceeds the compute time")
    else:
        lines.append("no collective overlaps with compute (overlap_data_collectives=False)")
    lines.append("tensor/sequence/context/expert/pipeline-parallel collectives and optimizer-phase collectives are "
                 "exposed (each output feeds the next operator; AsyncTP's overlap is not modelled)")
    if pipeline.stages > 1:
        lines.append(f"pipeline bubble ({pipeline.schedule}): (pp-1)/(v*m+pp-1) = {pipeline.bubble_fraction:.1%} of the "
                     f"pipelined time with pp={pipeline.stages}, m={pipeline.microbatches}, v={pipeline.virtual_stages} "
                     "(Narayanan et al. 2021)")
    lines.append(f"MFU against the {precision} dense peak, {peak / 1e12:g} TFLOP/s")
    return lines


__all__ = ["DATA_AXES", "DTYPE_PRECISIONS", "MIXED_PRECISION_PEAKS", "PHASES", "PIPELINE_SCHEDULES", "CollectiveTime",
           "OverlapAssumptions", "Pipeline", "StepTimeEstimate", "axes_spanning_nodes", "collective_seconds",
           "estimate_step_time", "op_precision", "op_seconds", "peak_precision"]
