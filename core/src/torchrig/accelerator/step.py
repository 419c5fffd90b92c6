"""The Accelerator's training-step calls: ``backward``, ``accumulate``, ``no_sync``, ``autocast``, unscaling and
clipping gradients, and the accumulation flags.

Each is one call into the step plan the plugins built at ``prepare`` (:mod:`torchrig.training.step_plan`):
nothing here decides per step what a strategy or precision does, which is why these calls sit apart from
the Accelerator's construction and ``prepare`` (:mod:`torchrig.accelerator.accelerator`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchrig.accelerator.step_contexts import AccumulateContext, adjusted_autocast
from torchrig.training.gradient_state import GradientState
from torchrig.training.step_plan import StepPlan


class StepCalls:
    """The training step for the :class:`~torchrig.Accelerator`, over ``self._plan`` (the step plan once built)."""

    _plan: StepPlan | None
    _step_plan: Callable[[], StepPlan]
    _run: Any
    _optimizers: list[Any]
    _accumulate: AccumulateContext
    gradient_state: GradientState
    device: Any

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """Backward through the step plan. With gradient accumulation the loss is divided by the
        number of accumulation steps here, exactly once (don't divide it yourself); a strategy
        that owns accumulation (DeepSpeed) scales it itself."""
        plan = self._plan or self._step_plan()
        caps = self._run.capabilities
        steps = self.gradient_state.num_steps
        if steps > 1 and not (caps is not None and caps.owns_accumulation):
            loss = loss / steps
        plan.backward(loss, **kwargs)

    def accumulate(self, *models: Any) -> Any:
        """Context for one micro-step: decides whether this step syncs gradients (every
        ``gradient_accumulation_steps`` steps, and at the end of the dataloader) and suppresses
        gradient communication on the others (``no_sync``)."""
        return self._accumulate.enter(models)

    def no_sync(self, model: Any) -> Any:
        """Suppress gradient synchronisation for ``model`` (through the strategy's no_sync)."""
        return (self._plan or self._step_plan()).no_sync(model)

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = value

    @property
    def optimizer_step_was_skipped(self) -> bool:
        """Whether the last optimizer step was skipped (fp16 overflow), on any prepared optimizer."""
        return any(optimizer.step_was_skipped for optimizer in self._optimizers)

    def autocast(self, autocast_handler: Any = None) -> Any:
        """The precision plugin's autocast, for computation outside the model's forward.
        ``autocast_handler`` (``AutocastKwargs``) adjusts it for this block: ``enabled=False``
        turns autocast off, ``cache_enabled`` sets the weight cache."""
        plan_autocast = (self._plan or self._step_plan()).autocast
        if autocast_handler is None:
            return plan_autocast()
        return adjusted_autocast(plan_autocast, self.device.type, autocast_handler)

    def unscale_gradients(self, optimizer: Any = None) -> None:
        """Make gradients true-scale (fp16) before inspecting or clipping them."""
        plan = self._plan or self._step_plan()
        targets = [optimizer] if optimizer is not None else self._optimizers
        for target in targets:
            plan.unscale_gradients(getattr(target, "optimizer", target))

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
        """Unscale, then clip the gradients' total norm (across shards when the strategy shards)."""
        self.unscale_gradients()
        return (self._plan or self._step_plan()).clip_grad_norm(parameters, max_norm, norm_type)

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        self.unscale_gradients()
        (self._plan or self._step_plan()).clip_grad_value(parameters, clip_value)


__all__ = ["StepCalls"]
