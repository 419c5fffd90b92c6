"""The prepared optimizer: ``step``/``zero_grad`` through the step plan, skipped while
gradients accumulate.

Hot path: every call here runs each micro-step, so it is a couple of attribute reads and one
plain call — no hooks, no allocation, no logging.
"""

from __future__ import annotations

from typing import Any

from torchrig.compat.resolve import module_attributes
from torchrig.gradient_state import GradientState
from torchrig.nested import send_to_device
from torchrig.step_plan import StepPlan


def move_to_device(state: Any, device: Any) -> Any:
    """An optimizer state (nested lists, tuples, dicts of tensors) with every tensor on ``device``."""
    return send_to_device(state, device)


class AcceleratedOptimizer:
    """Wraps the user's optimizer; other attributes (``param_groups``, ``state``...) pass through.

    ``step()`` runs the plan's ``optimizer_step`` only on a micro-step that syncs gradients
    (unless the strategy counts micro-steps itself, e.g. DeepSpeed); ``step_was_skipped`` is
    True after a skipped step (fp16 overflow) so schedulers don't advance.
    """

    def __init__(self, optimizer: Any, plan: StepPlan, gradient_state: GradientState, *, owns_accumulation: bool = False):
        self.optimizer = optimizer
        self.plan = plan
        self.gradient_state = gradient_state
        self.owns_accumulation = owns_accumulation
        self.step_was_skipped = False

    @property
    def is_accumulating(self) -> bool:
        """True on a micro-step whose optimizer step is deferred."""
        return not (self.owns_accumulation or self.gradient_state.sync_gradients)

    def step(self, closure: Any = None) -> None:
        if self.owns_accumulation or self.gradient_state.sync_gradients:
            if closure is not None:
                raise ValueError("closures are not supported by prepared optimizers; call step() without one")
            self.step_was_skipped = not self.plan.optimizer_step(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.owns_accumulation or self.gradient_state.sync_gradients:
            self.plan.zero_grad(self.optimizer, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    @property
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def defaults(self) -> Any:
        return self.optimizer.defaults

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # during unpickling, before __init__
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


__all__ = ["AcceleratedOptimizer", "move_to_device"]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
