"""The core's default scheduler wrapper: one scheduler step per applied optimizer step.

Accelerate steps a prepared scheduler ``num_processes`` times per call (its most reported
trap); torchrig never does. When a prepared optimizer reports that its last step was skipped
(fp16 overflow) or that gradients are still accumulating, the scheduler does not advance.

Two switches hand the schedule back to the user, stepping the scheduler on every call:
``Accelerator(step_scheduler_with_optimizer=False)`` and
``GradientAccumulationPlugin(adjust_scheduler=False)`` (a schedule written in micro-steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchrig.compat.resolve import module_attributes


class OptimizerStepScheduler:
    """Wraps a ``torch.optim.lr_scheduler`` scheduler; other attributes pass through."""

    def __init__(self, scheduler: Any, optimizers: Sequence[Any], gradient_state: Any = None) -> None:
        self.scheduler = scheduler
        self.optimizers = list(optimizers)
        self.gradient_state = gradient_state

    def step(self, *args: Any, **kwargs: Any) -> None:
        state = self.gradient_state
        if state is not None and not (state.step_scheduler_with_optimizer and state.adjust_scheduler):
            self.scheduler.step(*args, **kwargs)
            return
        for optimizer in self.optimizers:
            if getattr(optimizer, "is_accumulating", False) or getattr(optimizer, "step_was_skipped", False):
                return
        self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


__all__ = ["OptimizerStepScheduler"]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
