"""Ranks agree on the step a preemption stops at (see :mod:`torchrig.resilience.preemption` for the design).

Separate from :mod:`torchrig.resilience.preemption`, which stays torch-free: the worker wrapper imports that
one before the user's script, this one only the Accelerator does.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from torchrig.resilience.preemption import requested


class PreemptionWatch:
    """Per run: notes optimizer steps, agrees across ranks at step boundaries, calls ``stop`` once.

    ``stop(signal_name)`` is the Accelerator's: save, end, requeue, raise :class:`Preempted`.
    """

    def __init__(self, world_size: int, stop: Callable[[str], None]) -> None:
        self.world_size = world_size
        self.stop = stop
        # A gloo group of its own, created now (every rank constructs its Accelerator, in the same
        # order relative to other groups): CPU tensors under any backend, never ordered against
        # the training's collectives.
        self._group = dist.new_group(backend="gloo") if world_size > 1 else None
        #: Optimizer steps taken (synchronising ones: the step plan's ``optimizer_step`` ran).
        self.steps = 0
        self._checked_at = 0
        self._pending: tuple[Any, Any] | None = None  # (work, flag tensor) of the last agreement round
        self._stopping = False

    def wrap_optimizer_step(self, step: Callable[[Any], bool]) -> Callable[[Any], bool]:
        """The plan's ``optimizer_step``, counting steps (one attribute increment per call)."""

        def optimizer_step(optimizer: Any) -> bool:
            result = step(optimizer)
            self.steps += 1
            return result

        return optimizer_step

    def at_step_boundary(self, synced: bool) -> None:
        """Called by prepared DataLoaders before they read the next batch; ``synced`` is whether
        the micro-step that just ended synchronised gradients (a boundary mid-accumulation is
        not one: its gradients are in no checkpoint)."""
        if not synced or self.steps == self._checked_at or self._stopping:
            return
        self._checked_at = self.steps
        local = requested()
        if self.world_size <= 1:
            if local is not None:
                self._stop(local[0])
            return
        agreed = self._agreed()
        if agreed:
            self._stop(signal.Signals(agreed).name)
            return
        self._start_round(int(signal.Signals[local[0]]) if local is not None else 0)

    def _agreed(self) -> int:
        """The result of the previous round (started one step ago on every rank): the highest
        signal number any rank recorded (so every rank names the same signal), 0 for none."""
        if self._pending is None:
            return 0
        work, flag = self._pending
        self._pending = None
        work.wait()
        return int(flag.item())

    def _start_round(self, signum: int) -> None:
        flag = torch.tensor([signum], dtype=torch.int32)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True)
        self._pending = (work, flag)

    def _stop(self, signal_name: str) -> None:
        self._stopping = True
        self.stop(signal_name)


__all__ = ["PreemptionWatch"]
