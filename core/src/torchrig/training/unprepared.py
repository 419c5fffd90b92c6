"""A one-time check that the parameters a run trains belong to a prepared model.

Why: in a data-parallel run each process sees other batches, and only a model passed to
``accelerator.prepare`` has its gradients averaged across processes (DDP's all-reduce, FSDP2's
reduce-scatter, DeepSpeed's engine). A model that was never prepared — or a parameter kept
outside the prepared model, such as a learnable loss scale — trains on each process's own
gradients, so the replicas silently diverge while the run exits 0.

What is checked, once, and what is true of it:

* **only when ranks see different data** (the strategy's ``data_parallel_size`` > 1): in one
  process, or when every rank shares the batch (tensor parallel alone), nothing can diverge;
* at the **first backward that synchronizes gradients** (``accelerator.backward`` outside a
  ``no_sync``/accumulation micro-step): the parameters the loss's graph accumulates gradients
  into are read before the backward (one walk of the graph), and those that hold a gradient
  afterwards and belong to no prepared model are reported. A strategy that manages its own
  copies (FSDP2's unsharded parameters, DeepSpeed's partitions) consumes their gradients during
  the backward, so they hold none afterwards and are not reported;
* at the **first step of a prepared optimizer** and the **first** ``clip_grad_norm_``: the
  parameters given that hold a gradient and belong to no prepared model (this catches a plain
  ``loss.backward()``). Skipped where the strategy steps or clips itself (DeepSpeed: its
  optimizer holds its own flat partitions and is built from the model).

A model prepared without an optimizer is a prepared model: its gradients are averaged, so an
unprepared optimizer over it stays in step on every rank and nothing is reported. What it cannot
see: gradients the script averages itself (its own DDP wrapper, an ``all_reduce`` of a loss
scale's gradient) are reported too — the warning says how to silence it by preparing instead.

Cost: nothing after the first look — each check is a wrapper the accelerator puts into its step
plan while it is pending and drops (rebuilding the plan) once it has looked; in a run that is not
data parallel none is put in.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from torchrig.training.step_plan import StepPlan

#: The step-plan slots the check looks through.
CHECKED_SLOTS = ("backward", "optimizer_step", "clip_grad_norm")
#: Shown in the warning: how many parameter shapes to list.
_SHAPES_SHOWN = 3


class UnpreparedParameterWarning(RuntimeWarning):
    """Parameters outside every prepared model get gradients in a data-parallel run."""


class UnpreparedParameterCheck:
    """Armed until it has looked once at a synchronizing backward, a prepared optimizer's step
    or a clip; warns at most once. ``live_param_ids``: ids of the parameters the prepared models
    train; ``data_parallel_size``: the strategy's declared value; ``on_done``: called when a
    check has run (the accelerator rebuilds its step plan without that wrapper)."""

    def __init__(self, *, live_param_ids: Callable[[], set[int]], data_parallel_size: Callable[[], int | None],
                 syncing: Callable[[], bool], on_done: Callable[[], None]) -> None:
        self._live_param_ids = live_param_ids
        self._data_parallel_size = data_parallel_size
        self._syncing = syncing
        self._on_done = on_done
        self._pending = set(CHECKED_SLOTS)
        self.warned = False

    @property
    def active(self) -> bool:
        return bool(self._pending)

    def wrap_plan(self, plan: StepPlan) -> StepPlan:
        """``plan`` with the pending checks in front of its backward, optimizer step and clip."""
        return attrs.evolve(plan, **{slot: self.wrap(slot, getattr(plan, slot), plan.owners.get(slot, "core"))
                                     for slot in CHECKED_SLOTS})

    def wrap(self, slot: str, fn: Callable[..., Any], owner: str) -> Callable[..., Any]:
        """``fn`` (the plan's ``slot``) with the check in front while it is pending; ``fn`` itself
        otherwise. A strategy's own optimizer step or clip is not checked (see the module doc)."""
        if slot not in self._pending:
            return fn
        if not self._diverges() or (slot != "backward" and owner.startswith("strategy:")):
            self._pending.discard(slot)  # nothing to look at: out of the plan being built now
            return fn
        return {"backward": self._wrap_backward, "optimizer_step": self._wrap_optimizer_step,
                "clip_grad_norm": self._wrap_clip}[slot](fn)

    def _wrap_backward(self, backward: Callable[..., None]) -> Callable[..., None]:
        def checked_backward(loss: Any, **kwargs: Any) -> None:
            if "backward" not in self._pending or not self._syncing():
                backward(loss, **kwargs)
                return
            leaves = graph_parameters(loss)
            backward(loss, **kwargs)
            self._report(leaves, "accelerator.backward")
            self._done("backward")

        return checked_backward

    def _wrap_optimizer_step(self, step: Callable[[Any], bool]) -> Callable[[Any], bool]:
        def checked_step(optimizer: Any) -> bool:
            if "optimizer_step" in self._pending:
                self._report([p for group in optimizer.param_groups for p in group["params"]],
                             f"the prepared {type(optimizer).__name__}'s step")
                self._done("optimizer_step")
            return step(optimizer)

        return checked_step

    def _wrap_clip(self, clip: Callable[..., Any]) -> Callable[..., Any]:
        def checked_clip(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            if "clip_grad_norm" in self._pending:
                parameters = [parameters] if _is_tensor(parameters) else list(parameters)
                self._report(parameters, "accelerator.clip_grad_norm_")
                self._done("clip_grad_norm")
            return clip(parameters, *args, **kwargs)

        return checked_clip

    def _diverges(self) -> bool:
        return (self._data_parallel_size() or 1) > 1

    def _report(self, parameters: Iterable[Any], where: str) -> None:
        if self.warned:
            return
        live = self._live_param_ids()
        outside = [p for p in dict.fromkeys(parameters) if id(p) not in live and getattr(p, "grad", None) is not None]
        if not outside:
            return
        self.warned = True
        elements = sum(p.numel() for p in outside)
        shapes = ", ".join(str(tuple(p.shape)) for p in outside[:_SHAPES_SHOWN])
        more = f" and {len(outside) - _SHAPES_SHOWN} more" if len(outside) > _SHAPES_SHOWN else ""
        warnings.warn(
            f"{where} involves {len(outside)} parameter tensor(s) ({elements} elements; shapes {shapes}{more}) "
            f"that belong to no model passed to accelerator.prepare. This run is {self._data_parallel_size()}-way "
            "data parallel: their gradients are not averaged across processes, so every process trains its own, "
            "diverging copy. Pass the model to accelerator.prepare (model, optimizer = accelerator.prepare(model, "
            "optimizer)); a parameter that lives outside the model (a learnable loss scale) belongs on the model "
            "before prepare, or average its gradient yourself (accelerator.reduce(param.grad, 'mean')).",
            UnpreparedParameterWarning, stacklevel=4)

    def _done(self, slot: str) -> None:
        """``slot`` has been looked at: the plan is rebuilt without its wrapper."""
        self._pending.discard(slot)
        self._on_done()


def graph_parameters(loss: Any) -> list[Any]:
    """The leaf tensors requiring grad that a backward from ``loss`` accumulates into (the
    ``AccumulateGrad`` nodes of its graph), in the order found."""
    root = getattr(loss, "grad_fn", None)
    if root is None:
        return []
    found: dict[int, Any] = {}
    seen = {id(root)}
    todo = [root]
    while todo:
        node = todo.pop()
        variable = getattr(node, "variable", None)
        if variable is not None:
            found.setdefault(id(variable), variable)
        for child, _ in getattr(node, "next_functions", ()):
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                todo.append(child)
    return list(found.values())


def _is_tensor(value: Any) -> bool:
    return hasattr(value, "grad") and hasattr(value, "shape")


__all__ = ["CHECKED_SLOTS", "UnpreparedParameterCheck", "UnpreparedParameterWarning", "graph_parameters"]
