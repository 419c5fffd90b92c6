"""Effect assertions: proof that a feature changed what actually ran, not just a setting.

Accelerate's recent bugs were features that silently did nothing (FSDP2 ``no_sync`` issued every
reduce-scatter, the fp32 upcast was a no-op, ``compile_regions`` ran the eager model). A test that
reads back a configuration value cannot catch those; these assertions observe the run itself:

* :func:`record_forward_dtypes` / :func:`assert_forward_dtype` — the dtype the forward's matmuls,
  convolutions and attention kernels really ran in, seen by a ``TorchDispatchMode`` (below autocast
  and autograd, so after every cast) and attributed to the module whose forward was running;
* :func:`assert_master_weights` — the tensors the optimizer updates (and its state) are fp32;
* :func:`count_collectives` / :func:`assert_collectives` — the c10d collectives a block issued, by
  kind, read from the profiler's record of the dispatcher ops every process group call goes through
  (``c10d::allreduce_``...; DDP's C++ reducer and the functional collectives of DTensor and compiled
  graphs included);
* :func:`count_compilation` / :func:`assert_compiled` — frames dynamo compiled, graphs, graph breaks
  and recompilations during a block (the counters :mod:`torchrig.training.compile_check` reads);
* :func:`assert_modules_converted` — how many modules a conversion (fp8, quantization...) replaced.

Each assertion fails when it observed nothing at all, so a test using it cannot pass vacuously.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch
from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchrig.training.compile_check import dynamo_counters

# -- forward dtype -------------------------------------------------------------------------------

#: The ops whose dtype is "the compute dtype": matmuls, convolutions, attention kernels, fp8 matmuls.
COMPUTE_OPS = frozenset({
    "mm", "addmm", "_addmm_activation", "bmm", "baddbmm", "addbmm", "mv", "addmv", "_grouped_mm", "_scaled_mm",
    "_scaled_grouped_mm", "convolution", "_convolution", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
})
#: Scaled (fp8) matmuls: only the two matrices are their compute dtype, not their fp32 scales.
_SCALED_OPS = frozenset({"_scaled_mm", "_scaled_grouped_mm"})

ModuleSelector = str | type | tuple | Callable[[str, torch.nn.Module], bool] | None


@attrs.frozen
class ComputeCall:
    """One compute op of a forward: the innermost module running it, the op, and the dtypes (and
    tensor subclasses, e.g. ``DTensor`` or torchao's float8 tensor) of its floating-point inputs."""

    module: str
    op: str
    dtypes: tuple[torch.dtype, ...]
    tensor_types: tuple[str, ...]


@attrs.define
class ForwardRecord:
    """The compute ops seen during forwards of a model, in order."""

    modules: dict[str, torch.nn.Module]
    calls: list[ComputeCall] = attrs.field(factory=list)

    def select(self, modules: ModuleSelector = None) -> list[ComputeCall]:
        """The calls of the selected modules: a qualified name (with its children), a class or tuple
        of classes, a predicate ``(name, module) -> bool``, or ``None`` for all."""
        if modules is None:
            return list(self.calls)
        return [call for call in self.calls if _selected(modules, call.module, self.modules[call.module])]

    def dtypes(self, modules: ModuleSelector = None) -> set[torch.dtype]:
        """Every dtype the selected modules' compute ops took as input."""
        return {dtype for call in self.select(modules) for dtype in call.dtypes}

    def assert_dtype(self, dtype: torch.dtype, modules: ModuleSelector = None) -> None:
        """Every compute op of the selected modules ran on ``dtype`` inputs, and there was at least one."""
        calls = self.select(modules)
        if not calls:
            raise AssertionError(f"no matmul/convolution/attention op ran in the forward of {_describe(modules)} "
                                 f"(modules seen: {sorted({c.module for c in self.calls}) or 'none'})")
        wrong = [call for call in calls if any(d != dtype for d in call.dtypes)]
        if wrong:
            shown = "; ".join(f"{c.module}: {c.op} on {', '.join(map(str, c.dtypes))}" for c in wrong[:5])
            raise AssertionError(f"{len(wrong)} of {len(calls)} compute ops of {_describe(modules)} did not run in "
                                 f"{dtype}: {shown}")


def _selected(selector: ModuleSelector, name: str, module: torch.nn.Module) -> bool:
    if isinstance(selector, str):
        return name == selector or name.startswith(selector + ".")
    if isinstance(selector, (type, tuple)):
        return isinstance(module, selector)
    return bool(selector(name, module))


def _describe(selector: ModuleSelector) -> str:
    if selector is None:
        return "the model"
    if isinstance(selector, str):
        return repr(selector)
    if isinstance(selector, type):
        return f"{selector.__name__} modules"
    return f"the modules selected by {selector!r}"


class _ComputeMode(TorchDispatchMode):
    """Records compute ops while some watched module's forward runs (``stack`` is non-empty)."""

    def __init__(self, record: ForwardRecord, stack: list[str]):
        super().__init__()
        self.record, self.stack = record, stack

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if self.stack and name in COMPUTE_OPS:
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if name in _SCALED_OPS:
                tensors = tensors[:2]
            self.record.calls.append(ComputeCall(
                module=self.stack[-1], op=str(func), dtypes=tuple(t.dtype for t in tensors),
                tensor_types=tuple(type(t).__name__ for t in tensors if type(t) is not torch.Tensor)))
        return func(*args, **kwargs)


@contextlib.contextmanager
def record_forward_dtypes(model: torch.nn.Module) -> Iterator[ForwardRecord]:
    """Record the compute ops of every forward of ``model``'s modules inside the block.

    Forward hooks on each module keep the stack of running forwards; a dispatch mode sees each op
    after autocast and autograd (and after FSDP's parameter casts), so the dtypes are those the
    kernels received. Eager code only: inside a ``torch.compile`` graph no individual op is
    dispatched (use :func:`count_compilation` there). A forward recomputed by activation
    checkpointing during backward is recorded again."""
    named = dict(model.named_modules(remove_duplicate=False))
    root = type(model).__name__
    modules = {(name or root): module for name, module in named.items()}
    record = ForwardRecord(modules=modules)
    stack: list[str] = []
    handles = []
    for name, module in modules.items():
        def push(_module: Any, _args: Any, name: str = name) -> None:
            stack.append(name)

        def pop(_module: Any, _args: Any, _output: Any) -> None:
            stack.pop()

        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop, always_call=True))
    try:
        with _ComputeMode(record, stack):
            yield record
    finally:
        for handle in handles:
            handle.remove()


def assert_forward_dtype(model: torch.nn.Module, dtype: torch.dtype, run: Callable[[], Any], *,
                         modules: ModuleSelector = None) -> ForwardRecord:
    """Run ``run()`` and assert that every matmul/convolution/attention op of the forward of
    ``modules`` (all of ``model`` by default) ran on ``dtype`` inputs. Returns the record."""
    with record_forward_dtypes(model) as record:
        run()
    record.assert_dtype(dtype, modules)
    return record


# -- master weights ------------------------------------------------------------------------------


def assert_master_weights(optimizer: Any, dtype: torch.dtype = torch.float32, *,
                          model: torch.nn.Module | None = None) -> int:
    """The parameters ``optimizer`` updates, and its per-parameter state (``exp_avg``...), are
    ``dtype`` — whatever dtype the forward computes in. With ``model``, those parameters are also
    the model's own (the optimizer steps what the model holds, e.g. FSDP2's fp32 shards, not a
    copy). Reads ``param_groups``/``state``, so wrapped optimizers (torchrig's, DeepSpeed's ZeRO
    optimizer holding fp32 partitions) work. Returns the number of parameters checked."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params:
        raise AssertionError(f"{type(optimizer).__name__} updates no parameter")
    wrong = [f"#{i} {tuple(p.shape)} {p.dtype}" for i, p in enumerate(params) if p.dtype != dtype]
    state = getattr(optimizer, "state", {})
    for i, p in enumerate(params):
        for key, value in (state.get(p) or {}).items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() > 0 and value.dtype != dtype:
                wrong.append(f"#{i} state {key!r} {value.dtype}")
    if wrong:
        raise AssertionError(f"the optimizer's master weights are not {dtype}: {'; '.join(wrong[:8])}")
    if model is not None:
        held = {id(p) for p in model.parameters()}
        foreign = [i for i, p in enumerate(params) if id(p) not in held]
        if foreign:
            raise AssertionError(f"the optimizer updates {len(foreign)} tensor(s) that are not parameters of "
                                 f"{type(model).__name__} (parameter indexes {foreign[:8]})")
    return len(params)


# -- collectives ---------------------------------------------------------------------------------

#: Dispatcher ops of the process-group API (``c10d::``) and of the functional collectives
#: (``_c10d_functional::``, used by DTensor and compiled graphs; they call the former, and a
#: collective inside another counts once), by kind.
COLLECTIVE_OPS: dict[str, str] = {
    **{f"c10d::{op}": kind for kind, ops in {
        "all_reduce": ("allreduce_", "allreduce_coalesced_"),
        "reduce_scatter": ("reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"),
        "all_gather": ("allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_"),
        "broadcast": ("broadcast_",), "reduce": ("reduce_",), "gather": ("gather_",), "scatter": ("scatter_",),
        "all_to_all": ("alltoall_", "alltoall_base_"), "barrier": ("barrier",), "send": ("send",),
        "recv": ("recv_", "recv_any_source_"),
    }.items() for op in ops},
    **{f"_c10d_functional::{op}": kind for kind, ops in {
        "all_reduce": ("all_reduce", "all_reduce_", "all_reduce_coalesced", "all_reduce_coalesced_"),
        "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"),
        "all_gather": ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced"),
        "broadcast": ("broadcast", "broadcast_"), "all_to_all": ("all_to_all_single",),
    }.items() for op in ops},
}
COLLECTIVE_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather", "scatter",
                    "all_to_all", "barrier", "send", "recv")


@attrs.define
class CollectiveCounts:
    """Collectives issued by this process during a block, by kind (filled when the block ends)."""

    counts: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(COLLECTIVE_KINDS, 0))
    ops: list[str] = attrs.field(factory=list)  # the dispatcher ops, in order

    def __getitem__(self, kind: str) -> int:
        if kind not in self.counts:
            raise KeyError(f"unknown collective kind {kind!r}; the kinds are {', '.join(COLLECTIVE_KINDS)}")
        return self.counts[kind]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def as_dict(self) -> dict[str, int]:
        """The kinds issued at least once."""
        return {kind: n for kind, n in self.counts.items() if n}


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count the collectives this process issues inside the block, by kind.

    Every ``torch.distributed`` collective — the Python API, DDP's C++ reducer, FSDP2, DeepSpeed,
    DTensor and compiled graphs — goes through a ``c10d`` dispatcher op, which the (CPU-only,
    legacy) autograd profiler records on every thread that inherits its state (autograd's included).
    A running profiler cannot be nested: inside ``accelerator.profile()`` this raises. While
    torchrig's compile check watches its first steps, it sees this profiler and falls back to
    dynamo's counters."""
    if torch.autograd._profiler_enabled():
        raise RuntimeError("count_collectives: a profiler is already running (accelerator.profile() or "
                           "torch.profiler); collectives are counted with a profiler of their own")
    result = CollectiveCounts()
    profiler = torch.autograd.profiler.profile(use_kineto=False)
    with profiler:
        yield result
    for event in profiler.function_events:
        kind = COLLECTIVE_OPS.get(event.name)
        if kind is None or _inside_collective(event):
            continue
        result.counts[kind] += 1
        result.ops.append(event.name)


def _inside_collective(event: Any) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in COLLECTIVE_OPS:
            return True
        parent = parent.cpu_parent
    return False


def assert_collectives(counts: CollectiveCounts, *, total: int | range | None = None, **expected: int | range) -> None:
    """Assert collective counts by kind, each an exact number or a ``range``
    (``assert_collectives(c, reduce_scatter=3, all_reduce=0)``); ``total`` bounds all kinds together.
    Kinds not named are not checked."""
    unknown = sorted(set(expected) - set(COLLECTIVE_KINDS))
    if unknown:
        raise TypeError(f"assert_collectives: unknown kind(s) {unknown}; the kinds are {', '.join(COLLECTIVE_KINDS)}")
    checks = dict(expected, **({"total": total} if total is not None else {}))
    wrong = []
    for kind, want in checks.items():
        got = counts.total if kind == "total" else counts[kind]
        if got not in want if isinstance(want, range) else got != want:
            wrong.append(f"{kind}: expected {want}, issued {got}")
    if wrong:
        raise AssertionError(f"collectives: {'; '.join(wrong)} (all issued: {counts.as_dict() or 'none'})")


# -- compilation ---------------------------------------------------------------------------------


@attrs.define
class CompileCounts:
    """What dynamo compiled during a block (filled when it ends): frames compiled, graphs, graph
    breaks, and recompilations (compilations of a frame already compiled before)."""

    frames: int = 0
    graphs: int = 0
    graph_breaks: int = 0
    compilations: int = 0
    recompiles: int = 0


@contextlib.contextmanager
def count_compilation() -> Iterator[CompileCounts]:
    """Count dynamo's work inside the block: the deltas of its process-wide counters (as the
    compile check reads them) and, through its compile-end callback, each compilation with its
    compile id ``frame/attempt`` (attempt > 0: a recompile). Counts compilations, not runs: a cache
    hit compiles nothing (``accelerator.compile_report()`` says whether compiled code ran)."""
    result = CompileCounts()
    attempts: list[int] = []

    def on_end(args: CallbackArgs) -> None:
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            attempts.append(int(str(args.compile_id).rsplit("/", 1)[-1]))

    before = dynamo_counters()
    callback_handler.register_end_callback(on_end)
    try:
        yield result
    finally:
        callback_handler.remove_end_callback(on_end)
        after = dynamo_counters()
        result.frames = after.compiled_frames - before.compiled_frames
        result.graphs = after.graphs - before.graphs
        result.graph_breaks = after.graph_breaks - before.graph_breaks
        result.compilations = len(attempts)
        result.recompiles = sum(1 for attempt in attempts if attempt > 0)


def assert_compiled(counts: CompileCounts, *, min_frames: int = 1, max_recompiles: int | None = None,
                    max_graph_breaks: int | None = None) -> None:
    """Dynamo compiled at least ``min_frames`` frames into graphs during the block, with at most
    ``max_recompiles`` recompilations and ``max_graph_breaks`` graph breaks (unchecked when None)."""
    wrong = []
    if counts.frames < min_frames:
        wrong.append(f"{counts.frames} frame(s) compiled, expected at least {min_frames}")
    if min_frames and counts.graphs == 0:
        wrong.append("no graph was produced (everything ran eager)")
    if max_recompiles is not None and counts.recompiles > max_recompiles:
        wrong.append(f"{counts.recompiles} recompilation(s), expected at most {max_recompiles}")
    if max_graph_breaks is not None and counts.graph_breaks > max_graph_breaks:
        wrong.append(f"{counts.graph_breaks} graph break(s), expected at most {max_graph_breaks}")
    if wrong:
        raise AssertionError(f"torch.compile: {'; '.join(wrong)} ({counts})")


# -- converted modules ---------------------------------------------------------------------------


def assert_modules_converted(model: torch.nn.Module, to: type | tuple | Callable[[torch.nn.Module], bool], *,
                             count: int | None = None) -> list[str]:
    """``model`` holds exactly ``count`` modules (at least one when None) that a conversion produced:
    instances of ``to`` (a class or tuple of classes, e.g. torchao's ``Float8Linear``) or modules
    ``to(module)`` accepts. Returns their qualified names."""
    def match(module: torch.nn.Module) -> bool:
        return isinstance(module, to) if isinstance(to, (type, tuple)) else bool(to(module))

    names = [name or type(model).__name__ for name, module in model.named_modules() if match(module)]
    label = getattr(to, "__name__", repr(to))
    if count is None and not names:
        raise AssertionError(f"no module of {type(model).__name__} was converted to {label}")
    if count is not None and len(names) != count:
        raise AssertionError(f"{len(names)} module(s) converted to {label}, expected {count}: {names}")
    return names


__all__ = [
    "COLLECTIVE_KINDS", "COLLECTIVE_OPS", "COMPUTE_OPS", "CollectiveCounts", "CompileCounts", "ComputeCall",
    "ForwardRecord", "assert_collectives", "assert_compiled", "assert_forward_dtype", "assert_master_weights",
    "assert_modules_converted", "count_collectives", "count_compilation", "record_forward_dtypes",
]
