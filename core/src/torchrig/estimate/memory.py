"""Per-rank training memory, as data: what a model holds, what a strategy keeps of it on each rank.

Torch-free: strategy manifests answer :func:`~torchrig.plugin.hookspecs.torchrig_estimate_memory` from
these objects without importing torch or their libraries (``torchrig estimate-memory`` never
imports DeepSpeed). The model side (:class:`ModelFootprint`) is measured by
:mod:`torchrig.estimate.memory_model` on the meta device; the strategy side is arithmetic on it.

Every figure is *summed* per rank: parameters + gradients + optimizer state + master weights +
activations + transient buffers the strategy holds at the same time (an all-gathered FSDP unit,
DDP's gradient buckets). Accelerate's ``estimate-memory`` reports the largest single component,
which under-reports training memory by 3-4x.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:  # the type only: estimating imports no configuration machinery
    from torchrig.config.resolved import ResolvedConfig

#: Bytes per element of the dtypes a footprint or a precision names.
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
               "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1}
#: The compute dtype each precision plugin name stands for.
PRECISION_DTYPES = {"no": "float32", "fp16": "float16", "bf16": "bfloat16", "fp8": "float8_e4m3fn"}
#: Optimizer state per trainable element (bytes, fp32 state) and per parameter tensor (Adam's ``step``).
OPTIMIZERS = {"adamw": (8, 4), "adam": (8, 4), "sgd": (0, 0), "sgd_momentum": (4, 0), "adagrad": (4, 4),
              "rmsprop": (4, 4), "none": (0, 0)}
GIB = 1024 ** 3


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``dtype`` (``"float32"``, ``"torch.bfloat16"``)."""
    name = dtype.removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[name]


@attrs.frozen
class ParameterInfo:
    """One parameter tensor: its element count, its first dimension (FSDP2 shards and pads dim 0),
    its dtype, and whether it trains."""

    numel: int
    dim0: int
    dtype: str = "float32"
    trainable: bool = True

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_bytes(self.dtype)

    def shard_numel(self, world_size: int) -> int:
        """Elements of this rank's dim-0 shard, padded as FSDP2 pads (``ceil(dim0 / W)`` rows)."""
        if world_size <= 1 or self.dim0 == 0:
            return self.numel
        rows = -(-self.dim0 // world_size)
        return rows * (self.numel // self.dim0)


@attrs.frozen
class ModelFootprint:
    """What a model holds, measured once on the meta device (nothing allocated).

    ``unit_parameters``: elements of the largest repeated block (a member of the model's largest
    ``ModuleList``; the whole model when it has none) — FSDP2's unit of all-gather.
    ``activation_bytes``: bytes saved for backward by one forward at the requested batch (parameters
    and views of them excluded, each storage once); ``None`` with ``activation_note`` saying why.
    """

    name: str
    parameters: tuple[ParameterInfo, ...]
    buffer_bytes: int = 0
    unit_parameters: int = 0
    unit_name: str = ""
    activation_bytes: int | None = None
    activation_note: str = ""
    #: ``config.hidden_size`` of a transformers model (DeepSpeed sizes its buckets from it), else None.
    hidden_size: int | None = None

    @property
    def trainable(self) -> tuple[ParameterInfo, ...]:
        return tuple(p for p in self.parameters if p.trainable)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.parameters)

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel for p in self.trainable)

    @property
    def parameter_bytes(self) -> int:
        return sum(p.nbytes for p in self.parameters)

    def by_dtype(self) -> dict[str, int]:
        """Parameter elements per dtype."""
        out: dict[str, int] = {}
        for p in self.parameters:
            out[p.dtype] = out.get(p.dtype, 0) + p.numel
        return out


@attrs.frozen
class MemoryRequest:
    """What :func:`~torchrig.plugin.hookspecs.torchrig_estimate_memory` is asked about.

    ``precision`` is the selected precision plugin's name (``no``, ``fp16``, ``bf16``);
    ``optimizer_bytes_per_element`` the optimizer's fp32 state per trainable element (AdamW: 8)
    and ``optimizer_bytes_per_tensor`` its per-tensor state (AdamW's ``step``: 4);
    ``config`` the run's resolved configuration: a strategy reads its typed section,
    ``request.config.section_of(TheirOptions)`` (tests build one with ``torchrig.testing.resolved_config``).
    """

    model: ModelFootprint
    world_size: int
    #: The selected strategy's name, for labels only: the core answers for any strategy it is asked about.
    strategy: str = "single"
    precision: str = "no"
    optimizer_bytes_per_element: int = 8
    optimizer_bytes_per_tensor: int = 4
    config: ResolvedConfig = attrs.field(kw_only=True)

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the precision's compute dtype."""
        return dtype_bytes(PRECISION_DTYPES.get(self.precision, "float32"))


@attrs.frozen
class MemoryComponent:
    """One line of an estimate: ``bytes`` held per rank on ``location`` (``"device"`` or ``"cpu"``)."""

    name: str
    bytes: int
    location: str = "device"
    note: str = ""


@attrs.frozen
class MemoryEstimate:
    """Per-rank memory of one strategy/precision/world size, component by component."""

    strategy: str
    label: str
    world_size: int
    precision: str
    components: tuple[MemoryComponent, ...]
    notes: tuple[str, ...] = ()

    def total(self, location: str = "device") -> int:
        return sum(c.bytes for c in self.components if c.location == location)

    def component(self, name: str) -> int:
        """Bytes of the components called ``name`` (0 when absent)."""
        return sum(c.bytes for c in self.components if c.name == name)

    def as_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "label": self.label, "world_size": self.world_size,
                "precision": self.precision,
                "components": [attrs.asdict(c) for c in self.components],
                "total_device_bytes": self.total("device"), "total_cpu_bytes": self.total("cpu"),
                "notes": list(self.notes)}


# -- helpers for strategies --------------------------------------------------------------------


def sharded_elements(parameters: Iterable[ParameterInfo], world_size: int) -> int:
    """Elements one rank holds when every parameter is sharded on dim 0 over ``world_size``."""
    return sum(p.shard_numel(world_size) for p in parameters)


def optimizer_bytes(request: MemoryRequest, elements: int, tensors: int) -> int:
    return elements * request.optimizer_bytes_per_element + tensors * request.optimizer_bytes_per_tensor


def activation_component(request: MemoryRequest, note: str = "") -> tuple[list[MemoryComponent], list[str]]:
    """The activations line (whole on every rank: each rank runs its own micro-batch), or a note
    saying why there is none."""
    model = request.model
    if model.activation_bytes is None:
        return [], [f"activations not estimated: {model.activation_note}"]
    notes = [model.activation_note] if model.activation_note else []
    if request.precision != "no":
        notes.append(f"activations counted in fp32: an upper bound under {request.precision}, whose matmuls save "
                     "half-precision inputs")
    return [MemoryComponent("activations", model.activation_bytes, note=note)], notes


def replicated_estimate(request: MemoryRequest, strategy: str, label: str) -> MemoryEstimate:
    """Everything whole on every rank (one process, DDP): the core's default answer.

    Parameters and gradients in the parameters' own dtype (autocast computes in low precision but
    keeps fp32 parameters, which are then their own master weights); optimizer state over every
    trainable element; activations of one micro-batch.
    """
    model = request.model
    trainable = model.trainable
    components = [
        MemoryComponent("parameters", model.parameter_bytes + model.buffer_bytes,
                        note=f"{model.numel:,} elements, whole (buffers included)"),
        MemoryComponent("gradients", sum(p.nbytes for p in trainable), note="whole"),
        MemoryComponent("optimizer state", optimizer_bytes(request, model.trainable_numel, len(trainable)),
                        note="whole"),
    ]
    activations, notes = activation_component(request)
    if request.precision != "no":
        notes.append(f"{request.precision} autocast keeps fp32 parameters (they are the master weights): no copy")
    return MemoryEstimate(strategy, label, request.world_size, request.precision,
                          tuple(components + activations), tuple(notes))


def format_bytes(count: int) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if count >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count} B"


def format_estimate(estimate: MemoryEstimate) -> str:
    """A table of one estimate: component, bytes, where, note; then the totals."""
    title = f"{estimate.label} — {estimate.world_size} rank(s), mixed_precision={estimate.precision}, per rank"
    rows = [(c.name, format_bytes(c.bytes), c.location, c.note) for c in estimate.components]
    rows.append(("total (device)", format_bytes(estimate.total("device")), "device", "sum of the device lines"))
    if estimate.total("cpu"):
        rows.append(("total (cpu)", format_bytes(estimate.total("cpu")), "cpu", "offloaded"))
    widths = [max(len(r[i]) for r in [("component", "bytes", "where", "note"), *rows]) for i in range(3)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(("component", "bytes", "where"), widths)) + "  note"]
    for index, row in enumerate(rows):
        if index == len(estimate.components):
            lines.append("-" * (sum(widths) + 6))
        lines.append(f"{row[0].ljust(widths[0])}  {row[1].rjust(widths[1])}  {row[2].ljust(widths[2])}  {row[3]}")
    lines += [f"  note: {note}" for note in estimate.notes]
    return "\n".join(lines)


__all__ = [
    "DTYPE_BYTES", "OPTIMIZERS", "PRECISION_DTYPES", "MemoryComponent", "MemoryEstimate", "MemoryRequest",
    "ModelFootprint", "ParameterInfo", "activation_component", "dtype_bytes", "format_bytes", "format_estimate",
    "optimizer_bytes", "replicated_estimate", "sharded_elements",
]
