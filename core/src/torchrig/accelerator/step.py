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
from torchrig.training.token_loss import (
    IGNORE_INDEX,
    TokenCountWindow,
    checked_token_count,
    global_token_count,
    gradient_mean_group,
    local_token_count,
)


class StepCalls:
    """The training step for the :class:`~torchrig.Accelerator`, over ``self._plan`` (the step plan once built)."""

    _plan: StepPlan | None
    _step_plan: Callable[[], StepPlan]
    _run: Any
    _optimizers: list[Any]
    _accumulate: AccumulateContext
    gradient_state: GradientState
    device: Any
    strategy: str
    _models: list[Any]
    #: The valid tokens the micro-steps of the current accumulation window passed to ``backward``.
    _token_window: TokenCountWindow
    _step_token_count: int | None

    def backward(self, loss: Any, *, num_tokens: Any = None, num_items_in_batch: Any = None, **kwargs: Any) -> None:
        """Backward through the step plan. With gradient accumulation the loss is divided by the
        number of accumulation steps here, exactly once (don't divide it yourself); a strategy
        that owns accumulation (DeepSpeed) scales it itself.

        ``num_tokens``: ``loss`` is this micro-batch's loss *summed* over its ``num_tokens`` valid
        tokens; the gradients of the step become those of the sum over every valid token of every
        data-parallel/context-parallel rank and micro-step divided by their global number (one
        all-reduce of the count at the micro-step that syncs; not divided by the accumulation steps).
        ``num_items_in_batch``: transformers' convention — ``loss`` was already divided by this global
        count (:meth:`token_count`); it is multiplied by the data-parallel size (DDP/FSDP average
        gradients over ranks) and not divided by the accumulation steps.
        docs/parallelism.md, "Loss normalised by the token count"."""
        plan = self._plan or self._step_plan()
        caps = self._run.capabilities
        owns_accumulation = caps is not None and caps.owns_accumulation
        if num_tokens is not None or num_items_in_batch is not None:
            self._check_token_normalisation(owns_accumulation, num_tokens, num_items_in_batch)
        window = self._token_window
        if num_tokens is not None:
            window.add(checked_token_count(num_tokens))
            plan.backward(loss, **kwargs)
            if self.gradient_state.sync_gradients:
                self._step_token_count = window.finish(self._gradient_parameters(), caps, self.device)
            return
        if window.counted_steps:
            raise ValueError(window.mixed())
        window.uncounted = not self.gradient_state.sync_gradients
        if num_items_in_batch is not None:
            if isinstance(checked_token_count(num_items_in_batch, "num_items_in_batch"), int) and not num_items_in_batch:
                raise ValueError("accelerator.backward(num_items_in_batch=0): the step has no valid token on any rank, "
                                 "so a loss divided by it is undefined; skip the step's batches")
            _, size = gradient_mean_group(caps)
            loss = loss * size if size > 1 else loss
        else:
            steps = self.gradient_state.num_steps
            if steps > 1 and not owns_accumulation:
                loss = loss / steps
        plan.backward(loss, **kwargs)

    def _check_token_normalisation(self, owns_accumulation: bool, num_tokens: Any, num_items_in_batch: Any) -> None:
        if num_tokens is not None and num_items_in_batch is not None:
            raise ValueError("accelerator.backward: pass num_tokens (the loss is a sum over the micro-batch's tokens) "
                             "or num_items_in_batch (the loss is already divided by the step's global count), not both")
        if owns_accumulation:
            given = "num_tokens" if num_tokens is not None else "num_items_in_batch"
            raise ValueError(f"accelerator.backward({given}=...): the {self.strategy!r} strategy's engine owns "
                             "gradient accumulation and the optimizer step (it divides each loss by its own "
                             "accumulation steps), so the core cannot normalise the step's gradients by its token "
                             f"count; use the 'ddp' or 'fsdp' strategy for a token-normalised loss, or drop {given}")

    def _gradient_parameters(self) -> list[Any]:
        """The parameters the prepared optimizers step (those of the prepared models when there is none)."""
        groups = [group["params"] for optimizer in self._optimizers for group in optimizer.param_groups]
        params = [param for group in groups for param in group]
        if not params:
            params = [param for prepared in self._models for param in prepared.model.parameters()]
        return list({id(param): param for param in params}.values())

    @property
    def step_token_count(self) -> int | None:
        """The global valid-token count of the last optimizer step whose micro-steps passed
        ``num_tokens`` to :meth:`backward` (divide the summed loss by it to log the mean), else None."""
        return self._step_token_count

    def token_count(self, batches: Any, ignore_index: int = IGNORE_INDEX, shift: bool = True) -> int:
        """The valid labels (``!= ignore_index``) in ``batches`` — this step's micro-batches on this
        rank: a labels tensor, a batch mapping (``shift_labels``, else ``labels``) or a list of them —
        summed over the data-parallel (and context-parallel) ranks: transformers' ``num_items_in_batch``.
        ``shift``: count ``labels[..., 1:]``, as a causal LM's loss shifts them (transformers' Trainer
        counts so). A collective: call it on every rank. Then ``accelerator.backward(loss,
        num_items_in_batch=n)`` with the loss the model computed with ``num_items_in_batch=n``."""
        local = local_token_count(batches, ignore_index, shift)
        group, size = gradient_mean_group(self._run.capabilities)
        return global_token_count(local, group, size, self.device)

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
