"""The prepared optimizer: ``step``/``zero_grad`` through the step plan, skipped while
gradients accumulate.

Hot path: every call here runs each micro-step, so it is a couple of attribute reads and one
plain call — no hooks, no allocation, no logging.
"""

from __future__ import annotations

from typing import Any

import torch

from torchrig.compat.resolve import module_attributes
from torchrig.distributed.nested import send_to_device
from torchrig.training.gradient_state import GradientState
from torchrig.training.step_plan import StepPlan


def move_to_device(state: Any, device: Any) -> Any:
    """An optimizer state (nested lists, tuples, dicts of tensors) with every tensor on ``device``."""
    return send_to_device(state, device)


class AcceleratedOptimizer(torch.optim.Optimizer):
    """Wraps the user's optimizer; other attributes (``param_groups``, ``state``...) pass through.

    A ``torch.optim.Optimizer`` subclass, as Accelerate's wrapper is, so that APIs which type-check
    their optimizer accept it (torch's LR schedulers, ``transformers.get_scheduler``). Like
    Accelerate's, it never calls ``Optimizer.__init__``: it holds no parameters or state of its own;
    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's (read and assigned), and
    hook registries it lacks resolve to the wrapped optimizer's through ``__getattr__``.

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

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if self.owns_accumulation or self.gradient_state.sync_gradients:
            if closure is not None:
                raise ValueError("closures are not supported by prepared optimizers; call step() without one")
            self.step_was_skipped = not self.plan.optimizer_step(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.owns_accumulation or self.gradient_state.sync_gradients:
            self.plan.zero_grad(self.optimizer, set_to_none)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    @property  # type: ignore[override]
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, param_groups: Any) -> None:
        self.optimizer.param_groups = param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property  # type: ignore[override]
    def defaults(self) -> Any:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: Any) -> None:
        self.optimizer.defaults = defaults

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # during unpickling, before __init__
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    # torch.optim.Optimizer pickles only defaults/state/param_groups and re-patches step on load;
    # the wrapper's own attributes are what it is made of.
    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"AcceleratedOptimizer({self.optimizer!r})"


__all__ = ["AcceleratedOptimizer", "move_to_device"]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
