"""Proof that ``torch.compile`` took effect: a compile that silently runs the eager model
(Accelerate #4188/#4253: ``compile_regions`` ran the uncompiled model) looks like success.

How it is measured, and why this way (torch 2.13): dynamo's counters
(``torch._dynamo.utils.counters``) are process-wide and count only compilations, not cache hits, and
regional blocks of one class share one cached graph (the third block of a stack compiles nothing, yet
runs compiled code). What does mark every run of compiled code, cache hit or not, is the profiler
event ``Torch-Compiled Region: <frame>/<compile>`` that dynamo's guarded code records. So during the
first ``check_after_steps`` optimizer steps a forward pre-hook and hook on each compiled wrapper (the
``OptimizedModule``, whose hooks run in eager, outside the compiled frame) profile each call (CPU
events only, about 1 ms a call) and read the counter deltas around it: a call that recorded a
compiled region ran compiled code; frames dynamo compiled on a module's first call are its
compilation, frames compiled on later calls its recompilations. Where a profiler is already running
(``accelerator.profile``) a call counts as compiled only when dynamo compiled a frame for it. Then the
hooks are removed and the verifier leaves the step plan: the check costs nothing afterwards.
Recompilations after the check are seen through dynamo's compile-end callback, which runs only when
dynamo compiles, never on a cache hit. Only the forward is checked (the backward of a compiled
forward is compiled with it).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import attrs
import torch

#: Optimizer steps the hooks watch before the verdict (the default of ``dynamo_config.check_after_steps``).
CHECK_AFTER_STEPS = 2
#: Recompilations after the check above which one warning is given (the default of
#: ``dynamo_config.recompile_warn_threshold``; dynamo gives up on a frame at
#: ``torch._dynamo.config.recompile_limit``, 8: from then on that code runs eager).
RECOMPILE_WARN_THRESHOLD = 4
#: The profiler event dynamo's guarded code records around every run of a compiled graph.
COMPILED_REGION = "Torch-Compiled Region"


class DynamoCounters(NamedTuple):
    """Dynamo's process-wide counters, read in one place (the check, and the contract kit's
    ``torchrig.testing.effects.count_compilation``)."""

    frames: int  # frames dynamo looked at
    compiled_frames: int  # frames it compiled
    graphs: int
    graph_breaks: int


def dynamo_counters() -> DynamoCounters:
    """The counters now; subtract two readings for what happened in between."""
    from torch._dynamo.utils import counters  # dynamo costs ~1 s to import: only once something compiles

    return DynamoCounters(counters["frames"]["total"], counters["frames"]["ok"], counters["stats"]["unique_graphs"],
                          sum(counters["graph_break"].values()))


@attrs.define
class ModuleCompileStats:
    """What dynamo did for one compiled module (or region) while the check watched it."""

    calls: int = 0
    compiled_calls: int = 0
    frames: int = 0
    graphs: int = 0
    graph_breaks: int = 0
    recompiles: int = 0

    @property
    def compiled(self) -> bool:
        """Whether compiled code ran for it in some call, and that code holds a graph: a frame dynamo
        compiled into no graph (its forward under ``torch.compiler.disable``) runs everything eager.
        No frame of its own is a cache hit on a same-class block's graph (regional compilation)."""
        return self.compiled_calls > 0 and not (self.frames > 0 and self.graphs == 0)

    def as_dict(self) -> dict[str, Any]:
        return {"compiled": self.compiled, "calls": self.calls, "compiled_calls": self.compiled_calls, "frames": self.frames, "graphs": self.graphs,
                "graph_breaks": self.graph_breaks, "recompiles": self.recompiles}


def compiled_modules(model: torch.nn.Module, prefix: str) -> dict[str, torch.nn.Module]:
    """Every ``torch.compile`` wrapper in ``model`` (itself included), by qualified name. None
    while dynamo is not loaded: ``torch.compile`` loads it, so nothing was compiled (and a process
    that compiles nothing never pays dynamo's ~1 s import)."""
    found: dict[str, torch.nn.Module] = {}
    if "torch._dynamo" not in sys.modules:
        return found
    for name, module in model.named_modules(prefix=prefix, remove_duplicate=True):
        if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
            found[name] = module
    return found


class CompileVerifier:
    """Watches the compiled modules of the prepared models for the first steps, then warns about
    each one that did not run compiled code and keeps counting recompilations."""

    def __init__(self, on_done: Callable[[], None], check_after_steps: int = CHECK_AFTER_STEPS,
                 recompile_warn_threshold: int = RECOMPILE_WARN_THRESHOLD):
        self._on_done = on_done
        self.check_after_steps = check_after_steps
        self.recompile_warn_threshold = recompile_warn_threshold
        self.stats: dict[str, ModuleCompileStats] = {}
        self._pending: list[str] = []  # watched, no verdict yet
        self._handles: list[Any] = []
        self.steps = 0
        self.checked = False
        self.recompiles_after_check = 0
        self._warned_recompiles = False
        self._end_callback: Callable[..., None] | None = None

    @property
    def active(self) -> bool:
        """Whether the verifier still needs the plan's ``optimizer_step`` (modules watched, no verdict yet)."""
        return bool(self._handles) and not self.checked

    def watch(self, model: torch.nn.Module, name: str) -> None:
        """Hook every compiled wrapper in ``model`` (named ``name`` in the report). A model
        prepared after a verdict gets its own: ``check_after_steps`` more steps."""
        taken = {key.split(".")[0] for key in self.stats}
        unique, index = name, 1
        while unique in taken:  # two prepared models of one class: "Net", "Net#2"
            index += 1
            unique = f"{name}#{index}"
        found = compiled_modules(model, unique)
        if found and self.checked:
            self.close()
            self.checked, self.steps = False, 0
        for qualified, module in found.items():
            stats = self.stats.setdefault(qualified, ModuleCompileStats())
            self._pending.append(qualified)
            before: list[tuple[Any, DynamoCounters]] = []

            def pre_hook(_module: Any, _args: Any, before: list = before) -> None:
                profiler = None
                if not torch.autograd._profiler_enabled():
                    profiler = torch.autograd.profiler.profile(use_kineto=False)
                    profiler.__enter__()
                before.append((profiler, dynamo_counters()))

            def post_hook(_module: Any, _args: Any, _output: Any, stats: ModuleCompileStats = stats,
                          before: list = before) -> None:
                profiler, start = before.pop()
                after = dynamo_counters()
                _frames, ok, graphs, breaks = (b - a for a, b in zip(start, after))
                if profiler is not None:
                    profiler.__exit__(None, None, None)
                    ran = any(event.name.startswith(COMPILED_REGION) for event in profiler.function_events)
                else:
                    ran = ok > 0
                stats.compiled_calls += ran
                if stats.calls == 0:
                    stats.frames, stats.graphs = ok, graphs
                else:
                    stats.recompiles += ok
                stats.graph_breaks += breaks
                stats.calls += 1

            self._handles.append(module.register_forward_pre_hook(pre_hook))
            # always_call: a forward that raises must still stop the profiler the pre-hook started
            self._handles.append(module.register_forward_hook(post_hook, always_call=True))

    def wrap_optimizer_step(self, step: Callable[[Any], bool]) -> Callable[[Any], bool]:
        """The plan's ``optimizer_step``, giving the verdict after ``check_after_steps`` steps."""

        def optimizer_step(optimizer: Any) -> bool:
            result = step(optimizer)
            self.steps += 1
            if self.steps >= self.check_after_steps and not self.checked:
                self.verify()
            return result

        return optimizer_step

    def verify(self) -> None:
        """Remove the hooks, warn once per module that ran no compiled code, and from now on
        count recompilations through dynamo's compile-end callback."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.checked = True
        for name in self._pending:
            stats = self.stats[name]
            reason = _why_not_compiled(stats)
            if reason:
                warnings.warn(f"torch.compile: {name!r} did not run compiled code in the first {self.steps} "
                              f"optimizer steps: {reason}", RuntimeWarning, stacklevel=3)
            elif stats.graph_breaks:
                warnings.warn(f"torch.compile: {name!r} ran compiled code split by {stats.graph_breaks} graph "
                              "break(s); TORCH_LOGS=graph_breaks shows where", RuntimeWarning, stacklevel=3)
        self._pending.clear()
        self._end_callback = _count_recompiles(weakref.ref(self))
        _callback_handler().register_end_callback(self._end_callback)
        self._on_done()

    def _recompiled(self) -> None:
        self.recompiles_after_check += 1
        if self.recompiles_after_check > self.recompile_warn_threshold and not self._warned_recompiles:
            self._warned_recompiles = True
            warnings.warn(f"torch.compile: {self.recompiles_after_check} recompilations after the first "
                          f"{self.steps} steps (changing shapes, dtypes or Python values the graphs guard on); "
                          "TORCH_LOGS=recompiles says why", RuntimeWarning, stacklevel=2)

    def close(self) -> None:
        """Stop counting recompilations (the callback is process-wide)."""
        if self._end_callback is not None:
            _callback_handler().remove_end_callback(self._end_callback)
            self._end_callback = None

    def report(self) -> dict[str, Any]:
        """Per compiled module {compiled, calls, frames, graphs, graph_breaks, recompiles}, plus
        ``checked`` and the process-wide ``recompiles_after_check``."""
        return {"checked": self.checked, "recompiles_after_check": self.recompiles_after_check,
                "modules": {name: stats.as_dict() for name, stats in self.stats.items()}}


def _why_not_compiled(stats: ModuleCompileStats) -> str:
    if stats.calls == 0:
        return ("it was never called; the model that ran is not the compiled one (a module replaced or called "
                "through its original, e.g. `_orig_mod`, after compilation)")
    if stats.compiled_calls > 0 and stats.frames > 0 and stats.graphs == 0:
        return ("dynamo compiled its frame into no graph, so everything in it ran eager (a forward under "
                "torch.compiler.disable, or a graph break before any tensor operation)")
    if stats.compiled_calls == 0:
        return (f"it was called {stats.calls} time(s) and ran eager every time (compilation disabled: "
                "TORCH_COMPILE_DISABLE, torch._dynamo.config.disable or torch.compiler.disable; or dynamo skipped "
                "the frame)")
    return ""


def _callback_handler() -> Any:
    """Dynamo's process-wide compile callbacks; reached only after a verdict on compiled modules,
    so dynamo is loaded by then."""
    from torch._dynamo.callback import callback_handler

    return callback_handler


def _count_recompiles(verifier: weakref.ref) -> Callable[..., None]:
    """A compile-end callback that holds its verifier weakly (the handler is process-wide)."""

    def on_compile_end(*_args: Any) -> None:
        target = verifier()
        if target is not None:
            target._recompiled()

    return on_compile_end


__all__ = ["CHECK_AFTER_STEPS", "RECOMPILE_WARN_THRESHOLD", "CompileVerifier", "DynamoCounters", "ModuleCompileStats",
           "compiled_modules", "dynamo_counters"]
