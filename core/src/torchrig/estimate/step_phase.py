"""Which part of a training step is running: forward, backward, optimizer or other.

Why: what a collective or an operator can overlap with, and which memory is an activation,
depends on where in the step it happens. The recorders of one step
(:mod:`torchrig.estimate.recorder`, :mod:`torchrig.estimate.step_memory`) ask one
:class:`StepPhases` instead of each guessing.

The phase is found, in this order: the caller's explicit ``phases.phase = "..."`` (when not
``None``) wins; inside any ``Optimizer.step`` (torch's global step hooks) it is ``"optimizer"``;
while autograd's engine runs a graph task (``torch._C._current_graph_task_id() != -1``, also in
the callbacks FSDP2 queues at the end of backward) it is ``"backward"``; otherwise ``"forward"``.

Not the step's work: DTensor's sharding propagation runs each new operator once on fake tensors
of the *global* shapes (``ShardingPropagator.propagate_op_sharding_non_cached``) in the user's own
``FakeTensorMode``, so nothing about those operators tells them from the step's. While a
:class:`StepPhases` is entered that method is wrapped to raise :attr:`StepPhases.propagating`, which
the recorders check; torch's own ``MemTracker`` patches torch the same way (``UntypedStorage.resize_``).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Self

import torch
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

#: The phases a record can carry (``torchrig.estimate.costs.CollectiveRecord.phase``).
PHASES = ("forward", "backward", "optimizer", "other")


_propagation = threading.local()
_patch_lock = threading.Lock()
_patch_users = 0
_unpatched_propagation = ShardingPropagator.propagate_op_sharding_non_cached


@functools.wraps(_unpatched_propagation)
def _marked_propagation(self: ShardingPropagator, *args: Any, **kwargs: Any) -> Any:
    _propagation.depth = getattr(_propagation, "depth", 0) + 1
    try:
        return _unpatched_propagation(self, *args, **kwargs)
    finally:
        _propagation.depth -= 1


def _mark_propagation(install: bool) -> None:
    """Wrap DTensor's sharding propagation while at least one StepPhases is entered."""
    global _patch_users
    with _patch_lock:
        _patch_users += 1 if install else -1
        ShardingPropagator.propagate_op_sharding_non_cached = (  # type: ignore[method-assign]
            _marked_propagation if _patch_users > 0 else _unpatched_propagation)


class StepPhases:
    """The current phase of the step; a context manager that installs the optimizer hooks it needs.

    Every optimizer's ``step`` counts (torch's global hooks), so the optimizers need not be named.
    """

    def __init__(self) -> None:
        self._phase: str | None = None
        self._optimizer_depth = 0
        self._handles: list[Any] = []

    @property
    def phase(self) -> str:
        """The phase now (see the module docstring for the order of the rules)."""
        if self._phase is not None:
            return self._phase
        if self._optimizer_depth:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward"

    @property
    def propagating(self) -> bool:
        """Whether DTensor's sharding propagation is running (its operators are not the step's)."""
        return getattr(_propagation, "depth", 0) > 0

    @phase.setter
    def phase(self, value: str | None) -> None:
        if value is not None and value not in PHASES:
            raise ValueError(f"step phase {value!r} is not one of {', '.join(PHASES)} (or None: detect it)")
        self._phase = value

    def _enter_optimizer(self, *_: Any) -> None:
        self._optimizer_depth += 1

    def _leave_optimizer(self, *_: Any) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)

    def __enter__(self) -> Self:
        self._handles = [register_optimizer_step_pre_hook(self._enter_optimizer),
                         register_optimizer_step_post_hook(self._leave_optimizer)]
        _mark_propagation(install=True)
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._optimizer_depth = 0
        _mark_propagation(install=False)


__all__ = ["PHASES", "StepPhases"]
