"""Per-run gradient-accumulation and data-position state, shared by the Accelerator, prepared
optimizers, schedulers and dataloaders (through ``run.stash[GRADIENT_STATE]``, never a global)."""

from __future__ import annotations

from typing import Any, cast

import attrs

from torchrig.plugin.types import ACCUMULATION_STATE, StashKey


@attrs.define
class GradientState:
    """What the training step and the data layer tell each other.

    * ``sync_gradients`` — True on the micro-step that ends an accumulation cycle (the optimizer
      steps, gradients are synchronised); False while accumulating.
    * ``end_of_dataloader`` — the batch just yielded is the last of the innermost active
      dataloader (read off that loader: it keeps no per-batch flag of its own here).
    * ``step_boundary`` — what runs between two batches (preemption's agreement), or None.
    * ``remainder`` — on the last batch: how many samples of the final *global* batch are real
      (the rest repeat earlier samples to keep batches even); -1 when not known / not needed.
      ``gather_for_metrics`` keeps only that many.
    """

    num_steps: int = 1
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False
    adjust_scheduler: bool = True
    #: ``Accelerator(step_scheduler_with_optimizer=...)``: False steps schedulers on every call.
    step_scheduler_with_optimizer: bool = True
    sync_gradients: bool = True
    #: Micro-steps since the last optimizer step (0..num_steps-1).
    step: int = 0
    #: Dataloaders currently being iterated (innermost last).
    active_dataloaders: list[Any] = attrs.field(factory=list)
    #: Called by prepared dataloaders before they read the next batch, with ``sync_gradients``
    #: of the micro-step that just ended; set by the Accelerator when preemption is armed
    #: (:meth:`torchrig.resilience.preemption_watch.PreemptionWatch.at_step_boundary`), else None.
    step_boundary: Any = None

    @property
    def in_dataloader(self) -> bool:
        return bool(self.active_dataloaders)

    @property
    def end_of_dataloader(self) -> bool:
        loaders = self.active_dataloaders
        return bool(loaders) and loaders[-1].end_of_dataloader

    @property
    def remainder(self) -> int:
        loaders = self.active_dataloaders
        return loaders[-1].remainder if loaders else -1

    def adopt_strategy_steps(self, steps: int | None, *, configured: bool) -> None:
        """Count the micro-steps the strategy's configuration fixes (``Capabilities.accumulation_steps``)
        unless the run set its own (``configured``: a source set ``gradient_accumulation_steps``, or
        the count is not the default 1): the engine and ``accumulate()`` must count alike, and the
        core, not the strategy, writes this state. Conflicting explicit values were refused at
        configuration."""
        if steps is not None and not configured and self.num_steps == 1:
            self.num_steps = int(steps)

    def enter_dataloader(self, loader: Any) -> None:
        """``loader`` (innermost from now on) has ``end_of_dataloader`` and ``remainder``."""
        self.active_dataloaders.append(loader)

    def exit_dataloader(self, loader: Any) -> None:
        loaders = self.active_dataloaders
        if loaders and loaders[-1] is loader:  # the innermost (the usual case)
            loaders.pop()
        elif loader in loaders:
            loaders.remove(loader)


#: Where the run keeps its :class:`GradientState`: the key plugins read it by
#: (:data:`torchrig.plugin.types.ACCUMULATION_STATE`, typed read-only), typed for the core's writes.
GRADIENT_STATE = cast("StashKey[GradientState]", ACCUMULATION_STATE)


def gradient_state_of(run: Any) -> GradientState:
    """The run's gradient state, created on first use."""
    return run.stash.setdefault(GRADIENT_STATE, GradientState())


__all__ = ["GRADIENT_STATE", "GradientState", "gradient_state_of"]
