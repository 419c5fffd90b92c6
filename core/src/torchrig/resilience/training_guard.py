"""The training guard: a step whose loss or gradient norm is NaN/inf, or whose loss spiked, is
skipped on every rank (or stops the run naming it) instead of poisoning the weights.

* **Ranks agree.** A NaN can appear on one rank only (its batch, its shard of the gradients, a
  pipeline's last stage that alone sees the loss). At each optimizer step every rank contributes
  ``[non-finite flag, loss sum, loss count]`` to one ``all_reduce(SUM)`` on the default group —
  every rank of the job, each mesh axis and pipeline stage included — so all decide alike.
  When the step clipped its gradients the clipped total norm (already reduced across shards) is
  the one checked; otherwise each rank checks the norm of its own gradients.
* **Skip** zeroes the gradients and does not run the optimizer step; the prepared optimizer
  reports ``step_was_skipped``, so prepared schedulers do not advance. The weights stay those of
  the last applied step, as if the step's batches had never been trained on.
* **Stop** (or a bad step past ``max_skips``) raises :class:`TrainingGuardStop` naming the
  optimizer step and the micro-batches (counted from 0 since the guard was armed) it trained on.
* **Rollback** restarts the run from its last committed checkpoint without the step's batches,
  through the machinery that already resumes exactly (rewinding the user's ``for batch in
  loader`` in place cannot be done safely). Each backward records which batch (prepared
  dataloader, epoch, batch number) the active loaders handed out; on a bad step rank 0 adds them
  to the skip ledger beside the checkpoints (:mod:`torchrig.resilience.rollback_ledger`), every
  rank records the rollback in its status file and raises :class:`TrainingGuardRollback` (a
  ``SystemExit`` with ``rollback_exit_code``); ``torchrig launch`` restarts the ranks. When the
  restarted script calls ``load_state()``, each prepared loader is told the ledger's batches and
  never hands them out. Past ``max_rollbacks`` (counted in the ledger), with no checkpoint yet, or
  when the step's batches came from no prepared loader, :class:`TrainingGuardStop` says so.
* **Off costs nothing:** the Accelerator wraps the step plan only when ``training_guard.enabled``.
  On, it costs one small all-reduce and one host read of it per optimizer step.

Strategies whose engine owns the optimizer step and its overflow skipping (DeepSpeed: the
capability ``owns_accumulation``) are refused: the guard cannot skip a step it does not run.
fp16 loss scaling is refused too: its scaler must see every step it unscaled.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist

from torchrig.config.options import TrainingGuardConfig
from torchrig.resilience import run_status
from torchrig.resilience.rollback_ledger import SkippedBatch, describe_batches, ledger_path, read_ledger, write_ledger
from torchrig.training.step_plan import StepPlan

logger = logging.getLogger(__name__)

#: The metric each skipped step logs to the trackers (the run's total so far).
SKIPPED_STEPS_METRIC = "training_guard/skipped_steps"
#: The metric each rollback logs to the trackers (the checkpoints directory's total so far).
ROLLBACKS_METRIC = "training_guard/rollbacks"


class TrainingGuardStop(RuntimeError):
    """A bad step the guard was told not to skip (``stop``), one past ``max_skips`` or
    ``max_rollbacks``, or one it cannot roll back (no checkpoint yet)."""


class TrainingGuardRollback(SystemExit):
    """Raised on every rank once a rollback is recorded: ends the script with ``rollback_exit_code``
    so the launcher restarts it from the last checkpoint. A ``SystemExit``, so ``except Exception``
    in a script does not swallow it."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


@attrs.frozen
class StepVerdict:
    """What the ranks agreed about one optimizer step."""

    nonfinite: bool
    loss: float | None  # the mean over the ranks that computed a loss, None when none did
    spike: str | None  # why the loss is a spike, None when it is not


class TrainingGuard:
    """Checks each optimizer step through a wrapped :class:`StepPlan` (:meth:`wrap_plan`)."""

    def __init__(self, options: TrainingGuardConfig, *, device: Any, log: Callable[..., None],
                 latest_checkpoint: Callable[[], str | None] | None = None, dataloaders: Sequence[Any] = (),
                 active_dataloaders: Sequence[Any] = ()) -> None:
        """``latest_checkpoint`` (the run's newest committed checkpoint, raising when there can be none),
        ``dataloaders`` (the prepared ones, in prepare order) and ``active_dataloaders`` (those being
        iterated now, a live list) serve ``rollback``."""
        self.options = options
        self.device = device
        self._log = log
        self.rolls_back = "rollback" in (options.on_nonfinite, options.on_spike)
        self._latest_checkpoint = latest_checkpoint
        self._dataloaders = dataloaders
        self._active_dataloaders = active_dataloaders
        self._step_batches: dict[SkippedBatch, None] = {}  # the batches the step trained on (rollback only)
        self._window: deque[float] = deque(maxlen=options.spike_window)
        self._step_loss: Any = None  # the detached losses backward saw since the last optimizer step
        self._step_norm: Any = None  # the total norm clip_grad_norm returned this step
        self._verdict: StepVerdict | None = None  # decided at the step's first optimizer, kept for the others
        self.optimizer_steps = 0
        self.micro_batches = 0
        self._step_first_batch = 0
        self.skipped_steps = 0
        self._zero = torch.zeros((), device=device)
        self._one = torch.ones((), device=device)
        self._distributed: bool | None = None  # known at the first check: the process group may come later

    def check_supported(self, strategy: str, capabilities: Any, plan: StepPlan) -> None:
        """Refuse, naming why, what the guard cannot act on."""
        if capabilities is not None and capabilities.owns_accumulation:
            raise ValueError(f"training_guard.enabled: the {strategy!r} strategy's engine owns the optimizer step "
                             "and skips overflowing steps itself, so the guard cannot skip or check its steps; "
                             "use the 'ddp' or 'fsdp' strategy, or set training_guard.enabled: false")
        if plan.loss_scaler is not None:
            raise ValueError("training_guard.enabled: fp16 loss scaling already skips steps with inf/NaN gradients "
                             "and its scaler must see every step it unscaled; use mixed_precision 'bf16' or 'no' "
                             "with the guard, or set training_guard.enabled: false")

    def wrap_plan(self, plan: StepPlan) -> StepPlan:
        """``plan`` with backward recording the loss, clip_grad_norm the norm, optimizer_step checked."""
        backward, clip, step, zero_grad = plan.backward, plan.clip_grad_norm, plan.optimizer_step, plan.zero_grad

        def guarded_backward(loss: Any, **kwargs: Any) -> None:
            value = loss.detach().float()
            self._step_loss = value if self._step_loss is None else self._step_loss + value
            self.micro_batches += 1
            self._verdict = None
            backward(loss, **kwargs)

        def recording_backward(loss: Any, **kwargs: Any) -> None:
            self._record_batches()
            guarded_backward(loss, **kwargs)

        def guarded_clip(parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
            parameters = list(parameters) if not isinstance(parameters, torch.Tensor) else [parameters]
            self._step_norm = clip(parameters, max_norm, norm_type)
            return self._step_norm

        def guarded_step(optimizer: Any) -> bool:
            if self._verdict is None:
                self._verdict = self._agree(optimizer)
                self._finish_step(self._verdict)
            if self._verdict.nonfinite or self._verdict.spike:
                zero_grad(optimizer, True)
                return False
            return step(optimizer)

        return attrs.evolve(plan, backward=recording_backward if self.rolls_back else guarded_backward,
                            clip_grad_norm=guarded_clip, optimizer_step=guarded_step)

    def _record_batches(self) -> None:
        """Note which batch each prepared loader being iterated handed out last: the step trains on it."""
        for loader in self._active_dataloaders:
            position = loader.last_batch_position() if hasattr(loader, "last_batch_position") else None
            origin = getattr(loader, "resume_origin", loader)
            index = next((i for i, prepared in enumerate(self._dataloaders) if prepared is origin), None)
            if position is not None and index is not None:
                self._step_batches[SkippedBatch(index, *position)] = None

    def resume_without_skipped_batches(self, models: Any, directory: str) -> None:
        """``load_state`` pre-hook: tell each prepared loader the ledger's batches, so the resumed run
        never hands them out (the ledger of ``directory``'s checkpoints directory)."""
        ledger = read_ledger(os.path.dirname(os.path.abspath(directory)))
        for index, loader in enumerate(self._dataloaders):
            skipped = ledger.skipped(index)
            if hasattr(loader, "skip_batches"):
                loader.skip_batches(skipped)
            if skipped:
                logger.warning("training_guard: resuming from %s without the batches of %d rolled-back step(s) of "
                               "dataloader %d: %s", directory, ledger.rollbacks, index,
                               ", ".join(f"epoch {epoch} batch {batch}" for epoch, batch in sorted(skipped)))

    def _local_norm(self, optimizer: Any) -> Any:
        """The norm of this rank's gradients (of its shards, for sharded parameters): one fused kernel."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return self._zero
        if hasattr(grads[0], "to_local"):  # DTensor gradients: this rank's shards
            grads = [grad.to_local() for grad in grads]
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))

    def _agree(self, optimizer: Any) -> StepVerdict:
        """One all-reduce(SUM) of [gradient norm, loss, ranks with a loss]: a sum with a NaN/inf term
        is not finite, so every rank sees any rank's NaN."""
        norm = self._step_norm if self._step_norm is not None else self._local_norm(optimizer)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        loss = self._step_loss
        flags = torch.stack([norm.detach().float(), self._zero if loss is None else loss, self._zero if loss is None
                             else self._one])
        if self._distributed is None:
            self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self._distributed:
            dist.all_reduce(flags)
        total_norm, total_loss, count = flags.tolist()
        nonfinite = not (math.isfinite(total_norm) and math.isfinite(total_loss))
        mean = total_loss / count if count else None
        return StepVerdict(nonfinite=nonfinite, loss=mean, spike=None if nonfinite else self._spike(mean))

    def _spike(self, loss: float | None) -> str | None:
        if loss is None:
            return None
        threshold = self.options.spike_threshold
        if threshold is not None and loss > threshold:
            return f"loss {loss:.6g} above spike_threshold {threshold:g}"
        zscore = self.options.spike_zscore
        if zscore is not None and len(self._window) == self._window.maxlen:
            mean = sum(self._window) / len(self._window)
            std = math.sqrt(sum((x - mean) ** 2 for x in self._window) / len(self._window))
            if std > 0 and (loss - mean) / std > zscore:
                return f"loss {loss:.6g} is {(loss - mean) / std:.3g} standard deviations above the last " \
                       f"{len(self._window)} steps' mean {mean:.6g} (spike_zscore {zscore:g})"
        return None

    def _finish_step(self, verdict: StepVerdict) -> None:
        """Count the step; a good one joins the spike window, a bad one is skipped or stops the run."""
        step, first, last = self.optimizer_steps, self._step_first_batch, self.micro_batches - 1
        self.optimizer_steps += 1
        self._step_first_batch = self.micro_batches
        self._step_loss = None
        self._step_norm = None
        batches, self._step_batches = list(self._step_batches), {}
        if not (verdict.nonfinite or verdict.spike):
            if verdict.loss is not None:
                self._window.append(verdict.loss)
            return
        what = "a NaN/inf loss or gradient norm on at least one rank" if verdict.nonfinite else verdict.spike
        action = self.options.on_nonfinite if verdict.nonfinite else self.options.on_spike
        where = f"optimizer step {step} (micro-batches {first}–{last} since the guard was armed)"
        if action == "stop":
            raise TrainingGuardStop(f"training_guard: {what} at {where}; stopped (on_"
                                    f"{'nonfinite' if verdict.nonfinite else 'spike'}: stop)")
        if action == "rollback":
            self._roll_back(step, f"{what} at {where}, trained on {describe_batches(batches)}", batches)
        if self.skipped_steps >= self.options.max_skips:
            raise TrainingGuardStop(f"training_guard: {what} at {where}; {self.skipped_steps} steps already "
                                    f"skipped (max_skips {self.options.max_skips}): stopped. Lower the learning "
                                    "rate or inspect those batches; raise training_guard.max_skips to skip more")
        self.skipped_steps += 1
        logger.warning("training_guard: skipped %s: %s", where, what)
        self._log({SKIPPED_STEPS_METRIC: self.skipped_steps}, step=step)

    def _roll_back(self, step: int, named: str, batches: list[SkippedBatch]) -> None:
        """Record the step's batches in the skip ledger and end every rank with TrainingGuardRollback,
        or stop naming why a rollback is not possible. Every rank reads the same ledger before rank 0
        rewrites it (a barrier between), so all decide alike."""
        try:
            checkpoint = self._latest_checkpoint() if self._latest_checkpoint is not None else None
        except Exception as exc:  # e.g. no project_dir: there is no checkpoints directory to resume from
            raise TrainingGuardStop(f"training_guard: {named}; cannot roll back: {exc}") from exc
        if checkpoint is None:
            raise TrainingGuardStop(f"training_guard: {named}; cannot roll back: no checkpoint has been committed "
                                    "yet (save_state() before the bad step, or use 'skip')")
        if not batches:
            raise TrainingGuardStop(f"training_guard: {named}; cannot roll back: the step's batches did not come "
                                    "from a dataloader prepared by this Accelerator, so a restart would train on "
                                    "them again (prepare the loader, or use 'skip')")
        root = os.path.dirname(checkpoint)
        ledger = read_ledger(root)
        if ledger.rollbacks >= self.options.max_rollbacks:
            raise TrainingGuardStop(f"training_guard: {named}; {ledger.rollbacks} rollbacks already made from "
                                    f"{root} (max_rollbacks {self.options.max_rollbacks}): no rollback left, "
                                    f"stopped. Inspect those batches; raise training_guard.max_rollbacks, or delete "
                                    f"{ledger_path(root)} to forget the skipped batches")
        updated = ledger.with_rollback(step=step, checkpoint=os.path.basename(checkpoint), reason=named,
                                      batches=batches)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed:
            dist.barrier()  # every rank has read the ledger
        if not distributed or dist.get_rank() == 0:
            write_ledger(root, updated)
        message = (f"training_guard: {named}; rolling back to {checkpoint} without those batches (rollback "
                   f"{updated.rollbacks} of max_rollbacks {self.options.max_rollbacks})")
        logger.warning("%s", message)
        self._log({ROLLBACKS_METRIC: updated.rollbacks}, step=step)
        run_status.record(rollback={"checkpoint": checkpoint, "step": step, "rollbacks": updated.rollbacks,
                                    "batches": [attrs.asdict(batch) for batch in batches]})
        if distributed:
            dist.barrier()  # the ledger is written and every rank recorded the rollback before any exits
        raise TrainingGuardRollback(self.options.rollback_exit_code, message)


__all__ = ["ROLLBACKS_METRIC", "SKIPPED_STEPS_METRIC", "StepVerdict", "TrainingGuard", "TrainingGuardRollback",
           "TrainingGuardStop"]
