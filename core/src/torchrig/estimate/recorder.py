"""Record what one training step of one rank does: its collectives and its operators' costs.

Why one dispatch mode for both: every collective and every operator of the step passes through
torch's dispatcher, so a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees them all —
in a real run and in the fake one ``torchrig plan`` runs (torch's fake process group, tensors
under ``FakeTensorMode``: sizes and dtypes are real, nothing is computed or sent). One mode
walks the step once and tags both kinds of record with the same phase (:mod:`~torchrig.estimate.step_phase`).

What it sees, found on torch 2.13:

* c10d's ops (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``, ``c10d.allreduce_``, …:
  FSDP2, DDP's reducer, ``torch.distributed.*`` calls) and the functional collectives
  (``_c10d_functional.*``: DTensor redistributions, tensor parallel). DDP's bucket all-reduces are
  issued from C++ during backward and *are* seen; but DDP cannot run on the fake process group at
  all (its Work's future carries no value), hence :func:`record_ddp`.
* A mode sees an operator on DTensors *before* DTensor's dispatch, with global shapes. The
  recorder declines operators on any wrapper subclass (``NotImplemented``): DTensor, and the
  ``AsyncCollectiveTensor`` a real functional collective returns (the fake one returns a plain
  tensor — declining keeps real and fake records alike). The subclass unwraps and the plain
  operators — this rank's real compute — come back to the mode and are counted.
* ``_c10d_functional.batch_p2p_ops`` and ``_c10d_functional_autograd.*`` are not counted (the
  latter issue the counted ``_c10d_functional`` ops underneath).
"""

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Self

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from torchrig.estimate.costs import (
    CollectiveRecord,
    CollectiveSummary,
    OpCost,
    ring_wire_bytes,
    summarise_collectives,
)
from torchrig.estimate.step_phase import StepPhases

# (payload rule): which tensors make the collective's logical size (CollectiveRecord's docstring):
# "in" its input tensors, "out" its outputs, "in*n" / "out*n" those times the group size.
_C10D_COLLECTIVES: Mapping[str, tuple[str, str]] = {
    "_allgather_base_": ("all_gather", "out"),
    "allgather_": ("all_gather", "out"),
    "allgather_coalesced_": ("all_gather", "out"),
    "allgather_into_tensor_coalesced_": ("all_gather", "out"),
    "_reduce_scatter_base_": ("reduce_scatter", "in"),
    "reduce_scatter_": ("reduce_scatter", "in"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "in"),
    "allreduce_": ("all_reduce", "in"),
    "allreduce_coalesced_": ("all_reduce", "in"),
    "alltoall_": ("all_to_all", "in"),
    "alltoall_base_": ("all_to_all", "in"),
    "broadcast_": ("broadcast", "in"),
    "reduce_": ("reduce", "in"),
    "gather_": ("gather", "in*n"),
    "scatter_": ("scatter", "out*n"),
    "send": ("send", "in"),
    "recv_": ("recv", "in"),
    "recv_any_source_": ("recv", "in"),
    "barrier": ("barrier", "none"),
    "monitored_barrier_": ("barrier", "none"),
}
_FUNCTIONAL_COLLECTIVES: Mapping[str, tuple[str, str]] = {
    "all_gather_into_tensor": ("all_gather", "in*n"),
    "all_gather_into_tensor_out": ("all_gather", "in*n"),
    "all_gather_into_tensor_coalesced": ("all_gather", "in*n"),
    "reduce_scatter_tensor": ("reduce_scatter", "in"),
    "reduce_scatter_tensor_out": ("reduce_scatter", "in"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "in"),
    "all_reduce": ("all_reduce", "in"),
    "all_reduce_": ("all_reduce", "in"),
    "all_reduce_coalesced": ("all_reduce", "in"),
    "all_reduce_coalesced_": ("all_reduce", "in"),
    "all_to_all_single": ("all_to_all", "in"),
    "broadcast": ("broadcast", "in"),
    "broadcast_": ("broadcast", "in"),
    "isend": ("send", "in"),
    "irecv": ("recv", "in"),
}
_COLLECTIVE_NAMESPACES = {"c10d": _C10D_COLLECTIVES, "_c10d_functional": _FUNCTIONAL_COLLECTIVES}
#: Namespaces of communication ops that are neither collectives to record nor compute.
_COMMUNICATION_NAMESPACES = {"c10d", "_c10d_functional", "_c10d_functional_autograd", "c10d_functional"}
_INPUT_ARGS = {"tensors", "input", "inputs", "input_tensor", "input_tensors", "input_list", "tensor"}
_OUTPUT_ARGS = {"output", "outputs", "output_tensor", "output_tensors", "output_lists"}
#: Operators that move no data: allocation without initialisation, aliasing, metadata.
_NO_TRAFFIC = {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
               torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided, torch.ops.aten.detach,
               torch.ops.aten.lift_fresh, torch.ops.aten.alias, torch.ops.aten.set_,
               torch.ops.aten.resize_, torch.ops.aten._local_scalar_dense}


def mesh_axes(mesh: Any) -> dict[str, str]:
    """Process-group name -> mesh axis label, for every dimension of ``mesh``'s root mesh and every
    flattened dimension made from it (``mesh["dp_shard", "cp"]._flatten("dp_shard_cp")``).

    A dimension without a name is labelled ``dim<i>``. Where a flattened dimension spans the same
    ranks as the whole world its group is the default one, and it is labelled by its own name.
    """
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    names = root.mesh_dim_names or tuple(f"dim{i}" for i in range(root.ndim))
    axes: dict[str, str] = {}
    for flat_name, flat_mesh in getattr(root, "_flatten_mapping", {}).items():
        axes[flat_mesh.get_group().group_name] = flat_name
    for index, name in enumerate(names):
        axes[root.get_group(index).group_name] = name
    return axes


def _process_group(value: Any) -> dist.ProcessGroup:
    """The ProcessGroup a c10d op (a script object) or a functional collective (its name) runs on."""
    if isinstance(value, dist.ProcessGroup):
        return value
    if isinstance(value, str):
        return dist.distributed_c10d._resolve_process_group(value)
    return dist.ProcessGroup.unbox(value)


def _tensor_bytes(value: Any) -> int:
    return sum(leaf.numel() * leaf.element_size() for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor))


class StepRecorder(TorchDispatchMode):
    """Collectives (:class:`CollectiveRecord`) and operator costs (:class:`OpCost`) of the code run
    inside it.

    ``axes``: group name -> axis label (:func:`mesh_axes`); other groups are ``"world"`` (the
    default group) or ``"group:<name>"``. ``phase``: set it around parts of the step to label
    them explicitly; ``None`` (the default) detects forward/backward/optimizer
    (:class:`~torchrig.estimate.step_phase.StepPhases`). Operators folded by identical
    (name, flops, bytes, dtype) keep an 80-layer step to a few hundred cost records.
    """

    def __init__(self, axes: Mapping[str, str] | None = None, *, count_ops: bool = True) -> None:
        super().__init__()
        self.axes = dict(axes or {})
        self.count_ops = count_ops
        self.collectives: list[CollectiveRecord] = []
        self._phases = StepPhases()
        self._ops: dict[str, Counter[tuple[str, int, int, str, bool]]] = {}

    @property
    def phase(self) -> str:
        return self._phases.phase

    @phase.setter
    def phase(self, value: str | None) -> None:
        self._phases.phase = value

    def __enter__(self) -> Self:
        self._phases.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._phases.__exit__(*exc)

    # ---------------------------------------------------------------- results

    def summary(self) -> list[CollectiveSummary]:
        """Count and bytes per (axis, kind) over everything recorded."""
        return summarise_collectives(self.collectives)

    def op_costs(self, phase: str | None = None) -> list[OpCost]:
        """Operator costs folded by (name, flops, bytes, dtype), of one phase or of all."""
        folded: Counter[tuple[str, int, int, str, bool]] = Counter()
        for name, counts in self._ops.items():
            if phase is None or name == phase:
                folded.update(counts)
        return [OpCost(name=name, flops=flops, bytes=nbytes, dtype=dtype, matmul=matmul, count=count)
                for (name, flops, nbytes, dtype, matmul), count in sorted(folded.items())]

    def flops_by_phase(self) -> dict[str, int]:
        """Total FLOPs per phase (only phases that ran an operator)."""
        return {phase: sum(key[1] * count for key, count in counts.items())
                for phase, counts in self._ops.items()}

    # ---------------------------------------------------------------- recording

    def __torch_dispatch__(self, func: Any, types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        if any(is_traceable_wrapper_subclass_type(kind) for kind in types):
            return NotImplemented  # DTensor (or a waiting collective's result) unwraps; the plain ops come back
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace = func.namespace
        if namespace in _COMMUNICATION_NAMESPACES:
            rule = _COLLECTIVE_NAMESPACES.get(namespace, {}).get(func._schema.name.split("::")[-1])
            if rule is not None:
                self._record_collective(func, rule, args, kwargs)
        elif self.count_ops:
            self._record_op(func, args, kwargs, out)
        return out

    def _axis(self, group: dist.ProcessGroup) -> str:
        name = group.group_name
        if name in self.axes:
            return self.axes[name]
        if dist.is_initialized() and name == dist.group.WORLD.group_name:
            return "world"
        return f"group:{name}"

    def _record_collective(self, func: Any, rule: tuple[str, str], args: Sequence[Any],
                           kwargs: Mapping[str, Any]) -> None:
        kind, payload_rule = rule
        inputs: list[Any] = []
        outputs: list[Any] = []
        group: dist.ProcessGroup | None = None
        for index, argument in enumerate(func._schema.arguments):
            value = args[index] if index < len(args) else kwargs.get(argument.name)
            if argument.name in ("process_group", "group_name"):
                group = _process_group(value)
            elif argument.name in _INPUT_ARGS:
                inputs.append(value)
            elif argument.name in _OUTPUT_ARGS:
                outputs.append(value)
        if group is None:
            raise RuntimeError(f"the recorder found no process group among the arguments of {func} "
                               "(its schema changed?): update torchrig.estimate.recorder's collective table")
        size = group.size()
        source, _, times = payload_rule.partition("*")
        payload = 0 if source == "none" else _tensor_bytes(inputs if source == "in" else outputs)
        if times:
            payload *= size
        self.collectives.append(CollectiveRecord(
            kind=kind, axis=self._axis(group), group_size=size, payload_bytes=payload,
            wire_bytes=ring_wire_bytes(kind, payload, size), phase=self.phase))

    def _record_op(self, func: Any, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> None:
        packet = func._overloadpacket
        if func.is_view or packet in _NO_TRAFFIC or func.namespace == "prim" or self._phases.propagating:
            return
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        outputs = [leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)]
        if not tensors and not outputs:
            return
        matmul = packet in flop_registry
        flops = int(flop_registry[packet](*args, **kwargs, out_val=out)) if matmul else 0
        nbytes = sum(t.numel() * t.element_size() for t in (*tensors, *outputs))
        floating = [t.dtype for t in (*tensors, *outputs) if t.is_floating_point()]
        dtype = str(floating[0] if floating else (tensors or outputs)[0].dtype).removeprefix("torch.")
        key = (str(packet).removeprefix("aten."), flops, nbytes, dtype, matmul)
        self._ops.setdefault(self.phase, Counter())[key] += 1


def _divided_allreduce_hook(process_group: dist.ProcessGroup | None,
                            bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default gradient all-reduce (sum, then divide by the group size), issued as a plain
    ``dist.all_reduce`` and answered with an already-completed future: the fake process group's
    Work carries no value, which DDP's built-in path asserts on. (Annotations are evaluated in this
    module — no ``from __future__ import annotations`` — because DDP checks the hook's.)"""
    group = process_group or dist.group.WORLD
    buffer = bucket.buffer()
    dist.all_reduce(buffer, group=group)
    buffer.div_(dist.get_world_size(group))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def record_ddp(model: torch.nn.parallel.DistributedDataParallel) -> None:
    """Make a DDP model's gradient all-reduces run (and be recorded) on any process group, the fake
    one included: registers a comm hook that issues each bucket's all-reduce synchronously.

    Register it on the real run being compared with a planned one as well, so both issue the
    same collectives. Call before the first backward (DDP allows one comm hook).
    """
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"record_ddp needs a DistributedDataParallel model, got {type(model).__name__}")
    model.register_comm_hook(model.process_group, _divided_allreduce_hook)


__all__ = ["StepRecorder", "mesh_axes", "record_ddp"]
