"""The ``deepspeed`` strategy's runtime: one DeepSpeed engine per prepared model.

What it owns (its :class:`~torchrig.plugin.types.Capabilities`): backward (``engine.backward``, which
also divides the loss by the accumulation steps), the optimizer step and zero_grad
(``engine.step``, which steps only at accumulation boundaries, clips and zeroes), accumulation,
clipping (DeepSpeed clips to ``gradient_clipping`` inside its step), precision (the engine keeps
bf16/fp16 parameters and fp32 master weights; the precision plugin is not used) and the
checkpoint format (the engine's own files). The core's defaults for those phases are simply not
reached: the step plan's slots call the engine.

Several models per run (teacher/student, EMA, GAN) each get their own engine, built and found
again by :mod:`torchrig_deepspeed.engines`; ``backward`` finds the engine a loss belongs to (with
one trainable engine directly, else by the parameters in the loss's autograd graph), the prepared
optimizer and scheduler find theirs by identity. Clipping through the engine is
:mod:`torchrig_deepspeed.clipping`. This module holds the hook implementations.

The run's accumulation count is the core's: the strategy declares the count the DeepSpeed
configuration fixes (``Capabilities.accumulation_steps``), the core adopts it unless the run set
one, and the engine is built with the run's count, read back — never written here.

DeepSpeed is imported at the first ``prepare`` of a model, never at import of this module: the
launcher registers this object (for ``torchrig_worker_environment``) without paying for it.

Every option and "auto" value, and what DeepSpeed does on a CPU, is in ``docs/deepspeed.md``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torchrig.plugin import (
    ACCUMULATION_STATE,
    AccumulationState,
    Capabilities,
    LaunchPlan,
    OptimizerStepScheduler,
    PlanningUnsupported,
    PreparedModel,
    RunContext,
    StepPlanBuilder,
    get_logger,
    hookimpl,
)

from torchrig_deepspeed import checkpoint as ds_checkpoint
from torchrig_deepspeed import clipping
from torchrig_deepspeed.clipping import grad_norm
from torchrig_deepspeed.ds_config import micro_batch_of
from torchrig_deepspeed.ds_json import load_deepspeed_json
from torchrig_deepspeed.engines import (
    ENGINES,
    LOADERS,
    DeepSpeedStrategyError,
    EngineRecord,
    build_engine,
    deepspeed_options,
    engines_of,
    record_of_loss,
    record_of_module,
    record_of_optimizer,
    records_for,
)
from torchrig_deepspeed.options import DeepSpeedPlugin
from torchrig_deepspeed.placeholders import EngineBuiltScheduler

logger = get_logger(__name__)

#: Why ``torchrig plan`` cannot lay a DeepSpeed run out (``torchrig_prepare_model`` when planning).
PLANNING_REFUSAL = (
    "strategy 'deepspeed' cannot be planned on the meta device: deepspeed.initialize needs the parameters' "
    "real storage — it moves the model onto the device, broadcasts rank 0's weights, and its ZeRO optimizer "
    "(stages 1-2) copies the parameters into flat partitioned buffers, while ZeRO-3 partitions the parameters "
    "themselves as the engine is built; a meta-device model has no storage for any of these. The plan reports "
    "the strategy's memory estimate instead")


class DeepSpeedStrategy:
    """DeepSpeed runtime. One instance per plugin host (per Accelerator)."""

    # -- launch ---------------------------------------------------------------------------------

    @hookimpl
    def torchrig_worker_environment(self, plan: LaunchPlan) -> dict[str, str]:
        """Without a CUDA GPU, DeepSpeed must use its CPU accelerator (and gloo)."""
        if "DS_ACCELERATOR" in os.environ or torch.cuda.is_available():
            return {}
        return {"DS_ACCELERATOR": "cpu"}

    # -- environment ------------------------------------------------------------------------------

    @hookimpl
    def torchrig_init_process_group(self, run: RunContext) -> bool | None:
        """DeepSpeed needs a process group even for one process (its collectives are called
        unconditionally); the core creates none then, so make a one-rank group on an in-memory
        store (no port). Several processes: the core's default group, which DeepSpeed adopts."""
        import torch.distributed as dist

        if run.cluster.world_size > 1 or dist.is_initialized():
            return None
        assert run.device is not None
        dist.init_process_group(backend=run.device.dist_backend, store=dist.HashStore(), rank=0, world_size=1)
        return True

    @hookimpl
    def torchrig_configure(self, run: RunContext) -> None:
        run.stash[ENGINES] = []
        run.stash[LOADERS] = []
        # DeepSpeed reads these even when torch.distributed is initialised (torch elastic sets
        # them; Slurm, MPI and one-process runs may not).
        cluster = run.cluster
        for name, value in (("LOCAL_RANK", cluster.local_rank), ("RANK", cluster.rank),
                            ("WORLD_SIZE", cluster.world_size), ("LOCAL_WORLD_SIZE", cluster.local_world_size)):
            os.environ.setdefault(name, str(value))
        assert run.device is not None
        if run.device.device.type == "cpu" and "DS_ACCELERATOR" not in os.environ and "deepspeed" not in sys.modules:
            os.environ["DS_ACCELERATOR"] = "cpu"  # picked up when DeepSpeed is imported at prepare

    @hookimpl
    def torchrig_strategy_capabilities(self, run: RunContext) -> Capabilities:
        """The engine counts micro-steps and divides the loss itself; the count its configuration
        fixes is declared so the core's ``accumulate()`` counts the same."""
        return Capabilities(owns_accumulation=True, owns_precision=True,
                            accumulation_steps=_configured_accumulation(deepspeed_options(run)),
                            data_parallel_size=run.cluster.world_size, data_parallel_rank=run.cluster.rank)

    # -- preparation -----------------------------------------------------------------------------

    @hookimpl
    def torchrig_prepare_model(
        self, run: RunContext, model: Any, optimizers: Sequence[Any], schedulers: Sequence[Any], device_placement: bool
    ) -> PreparedModel:
        if run.planning:  # before DeepSpeed is imported or the model touched
            raise PlanningUnsupported(PLANNING_REFUSAL)
        return build_engine(run, model, optimizers, schedulers, device_placement,
                            accumulation_steps=accumulation_of(run).num_steps)

    @hookimpl(wrapper=True)
    def torchrig_prepare_dataloader(self, run: RunContext, dataloader: Any, device_placement: bool) -> Any:
        """Remember each prepared dataloader: its per-rank batch size is DeepSpeed's micro batch.
        Engines built before any dataloader (``prepare(model, optimizer, loader)`` prepares the model
        first) got a provisional one, corrected here."""
        prepared = yield
        loaders = run.stash.setdefault(LOADERS, [])
        loaders.append(prepared)
        micro = micro_batch_of(loaders, deepspeed_options(run).is_train_batch_min)
        if micro is not None:
            for record in engines_of(run):
                if record.built.micro_batch_pending:
                    record.engine.set_train_micro_batch_size(micro)
                    record.built.config["train_micro_batch_size_per_gpu"] = micro
                    record.built.config["train_batch_size"] = record.engine.train_batch_size()
        return prepared

    @hookimpl
    def torchrig_prepare_scheduler(self, run: RunContext, scheduler: Any, optimizers: Sequence[Any]) -> Any:
        if isinstance(scheduler, EngineBuiltScheduler):
            return scheduler  # the engine steps it
        records = [r for r in (record_of_optimizer(run, o) for o in optimizers) if r is not None]
        if not records:
            return None
        return EngineScheduler(scheduler, records[0], accumulation_of(run))

    @hookimpl
    def torchrig_strategy_step_plan(self, run: RunContext, plan: StepPlanBuilder) -> None:
        records = engines_of(run)
        state = accumulation_of(run)

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            unknown = sorted(set(kwargs) - {"retain_graph"})
            if unknown:
                raise TypeError(f"deepspeed: engine.backward accepts retain_graph only, not {', '.join(unknown)}")
            record = record_of_loss(records, loss)
            if record is None:  # the loss reaches no prepared model's trainable parameters
                loss.backward(**kwargs)
                return
            record.engine.set_gradient_accumulation_boundary(state.sync_gradients)
            record.engine.backward(loss, **kwargs)

        def optimizer_step(optimizer: Any) -> bool:
            record = record_of_optimizer(run, optimizer)
            if record is None:
                raise DeepSpeedStrategyError(
                    f"deepspeed: this {type(optimizer).__name__} belongs to no DeepSpeed engine; prepare it together "
                    "with its model (accelerator.prepare(model, optimizer)) so the engine steps it")
            engine = record.engine
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if not boundary:
                return True  # a micro-step: nothing was due, nothing was skipped
            applied = bool(engine.was_step_applied())
            record.applied_steps += applied
            return applied

        def clip_grad_norm(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
            return clipping.clip_grad_norm(run, records, parameters, max_norm, norm_type)

        plan.set("backward", backward)
        plan.set("optimizer_step", optimizer_step)
        plan.set("zero_grad", _engine_zeroes)
        plan.set("unscale_gradients", _engine_unscales)
        plan.set("clip_grad_norm", clip_grad_norm)
        plan.set("clip_grad_value", clipping.refuse_value_clipping)
        plan.set("no_sync", _engine_accumulates)

    # -- checkpoints -------------------------------------------------------------------------------

    @hookimpl
    def torchrig_save_strategy_state(self, run: RunContext, prepared: Sequence[PreparedModel], directory: str,
                                     writer: Any) -> list[str]:
        return ds_checkpoint.save_state(run, records_for(run, prepared), directory, writer)

    @hookimpl
    def torchrig_load_strategy_state(self, run: RunContext, prepared: Sequence[PreparedModel], directory: str,
                                     manifest: Any, allow_pickle: bool) -> bool:
        ds_checkpoint.load_state(run, records_for(run, prepared), directory, manifest, allow_pickle)
        return True

    @hookimpl
    def torchrig_full_state_dict(self, run: RunContext, prepared: PreparedModel) -> dict[str, Any] | None:
        record = record_of_module(run, prepared.unwrapped)
        if record is None:
            return None
        return ds_checkpoint.full_state_dict(run, record)


# -- the scheduler ------------------------------------------------------------------------------------


class EngineScheduler(OptimizerStepScheduler):
    """The script's scheduler, stepped once per optimizer step the engine applied.

    The engine decides at its ``step()`` whether an update happens (accumulation boundary, no
    fp16 overflow); ``scheduler.step()`` advances only if an update happened since its last
    advance. ``step_scheduler_with_optimizer=False`` and ``adjust_scheduler=False`` step it on
    every call, as with the other strategies."""

    def __init__(self, scheduler: Any, record: EngineRecord, gradient_state: AccumulationState) -> None:
        super().__init__(scheduler, [], gradient_state)
        self.record = record
        self._seen = record.applied_steps

    def step(self, *args: Any, **kwargs: Any) -> None:
        state = self.gradient_state
        if not (state.step_scheduler_with_optimizer and state.adjust_scheduler):
            self.scheduler.step(*args, **kwargs)
            return
        if self.record.applied_steps > self._seen:
            self._seen = self.record.applied_steps
            self.scheduler.step(*args, **kwargs)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._seen = self.record.applied_steps


# -- step-plan helpers --------------------------------------------------------------------------------


def _engine_zeroes(optimizer: Any, set_to_none: bool = True) -> None:
    """The engine zeroes gradients after each step it applies; zeroing here would drop the
    micro-steps accumulated so far."""


def _engine_unscales(optimizer: Any) -> None:
    """fp16 loss scaling is the engine's: gradients are unscaled inside its step."""


def _engine_accumulates(model: Any) -> contextlib.AbstractContextManager[None]:
    """The engine reduces gradients only at accumulation boundaries, which ``backward`` sets."""
    return contextlib.nullcontext()


# -- accumulation: the core's count, read ---------------------------------------------------------------


def accumulation_of(run: RunContext) -> AccumulationState:
    """The run's gradient accumulation, read-only: the core counts micro-steps and, at ``prepare``,
    adopted the count this strategy declared (``Capabilities.accumulation_steps``) unless the run
    set its own — the engine is built with that one count."""
    return run.stash[ACCUMULATION_STATE]


def _configured_accumulation(options: DeepSpeedPlugin) -> int | None:
    """The micro-steps the DeepSpeed configuration fixes: ``deepspeed_config.gradient_accumulation_steps``,
    else a number in the DeepSpeed JSON, else None (``"auto"`` or absent: the run's count). A
    top-level ``gradient_accumulation_steps`` that disagrees was refused before launch."""
    if options.gradient_accumulation_steps is not None:
        return int(options.gradient_accumulation_steps)
    if options.hf_ds_config is None:
        return None
    value = load_deepspeed_json(options.hf_ds_config).data.get("gradient_accumulation_steps")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


__all__ = ["ENGINES", "LOADERS", "DeepSpeedStrategy", "DeepSpeedStrategyError", "EngineRecord", "EngineScheduler",
           "accumulation_of", "deepspeed_options", "grad_norm"]
