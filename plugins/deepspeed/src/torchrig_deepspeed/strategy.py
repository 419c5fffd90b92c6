"""The ``deepspeed`` strategy's runtime: one DeepSpeed engine per prepared model.

What it owns (its :class:`~torchrig.plugin.types.Capabilities`): backward (``engine.backward``, which
also divides the loss by the accumulation steps), the optimizer step and zero_grad
(``engine.step``, which steps only at accumulation boundaries, clips and zeroes), accumulation,
clipping (DeepSpeed clips to ``gradient_clipping`` inside its step), precision (the engine keeps
bf16/fp16 parameters and fp32 master weights; the precision plugin is not used) and the
checkpoint format (the engine's own files). The core's defaults for those phases are simply not
reached: the step plan's slots call the engine.

Several models per run (teacher/student, EMA, GAN) each get their own engine. ``backward``
finds the engine a loss belongs to (with one trainable engine directly, else by the parameters
in the loss's autograd graph); the prepared optimizer and scheduler find theirs by identity.

DeepSpeed is imported at the first ``prepare`` of a model, never at import of this module: the
launcher registers this object (for ``torchrig_worker_environment``) without paying for it.

Every option and "auto" value, and what DeepSpeed does on a CPU, is in ``docs/deepspeed.md``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
from torchrig.config.options import DataLoaderConfiguration
from torchrig.host.run import RunContext
from torchrig.logging import get_logger
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import (
    ACCUMULATION_STATE,
    AccumulationState,
    Capabilities,
    LaunchPlan,
    PreparedModel,
    StashKey,
)
from torchrig.scheduler import OptimizerStepScheduler
from torchrig.training.step_plan import StepPlanBuilder

from torchrig_deepspeed import checkpoint as ds_checkpoint
from torchrig_deepspeed.config_checks import SECTION
from torchrig_deepspeed.ds_config import EngineConfig, engine_config, micro_batch_of
from torchrig_deepspeed.ds_json import load_deepspeed_json
from torchrig_deepspeed.jit_ops import watching_jit_builds
from torchrig_deepspeed.options import DeepSpeedPlugin
from torchrig_deepspeed.placeholders import DummyScheduler, EngineBuiltScheduler

logger = get_logger(__name__)


class DeepSpeedStrategyError(RuntimeError):
    """The deepspeed strategy cannot do what the script asked; the message says how to fix it."""


@attrs.define(eq=False)
class EngineRecord:
    """One prepared model's engine and what the step plan needs to find it fast."""

    #: Position among the models prepared in this run (names its checkpoint tag).
    index: int
    engine: Any
    #: The user's module (``engine.module``).
    module: Any
    #: ``id`` of every trainable parameter (for ``backward`` and ``clip_grad_norm_``).
    params: frozenset[int]
    #: The optimizer handed back by ``prepare`` (DeepSpeed's basic optimizer: the script's own, or
    #: the one built from the JSON's ``optimizer`` block); None for a model without one.
    optimizer: Any
    built: EngineConfig
    #: Optimizer steps the engine applied (not skipped on overflow); schedulers follow it.
    applied_steps: int = 0

    @property
    def tag(self) -> str:
        return ds_checkpoint.tag_for(self.index)


#: Engines of this run, in prepare order.
ENGINES = StashKey[list[EngineRecord]]("deepspeed.engines")
#: Dataloaders prepared in this run (their batch size fills train_micro_batch_size_per_gpu).
LOADERS = StashKey[list[Any]]("deepspeed.dataloaders")


def deepspeed_options(run: RunContext) -> DeepSpeedPlugin:
    """The resolved ``deepspeed_config`` section."""
    return run.section(DeepSpeedPlugin)


def engines_of(run: RunContext) -> list[EngineRecord]:
    return run.stash.setdefault(ENGINES, [])


def record_of_module(run: RunContext, module: Any) -> EngineRecord | None:
    for record in engines_of(run):
        if module is record.module or module is record.engine:
            return record
    return None


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
        deepspeed = _import_deepspeed(run)
        if len(optimizers) > 1:
            raise DeepSpeedStrategyError(
                f"deepspeed: {type(model).__name__} has {len(optimizers)} optimizers over its parameters, but a DeepSpeed "
                "engine drives one; use one optimizer with several param groups")
        options = deepspeed_options(run)
        records = engines_of(run)
        optimizer = optimizers[0] if optimizers else None
        built = engine_config(
            options, mixed_precision=str(run.option("mixed_precision") or "no"),
            accumulation_steps=accumulation_of(run).num_steps, world_size=run.cluster.world_size,
            micro_batch=micro_batch_of(run.stash.get(LOADERS) or [], options.is_train_batch_min),
            model=model, optimizer=optimizer, scheduler=schedulers[0] if schedulers else None,
            split_batches=bool(run.section(DataLoaderConfiguration).split_batches))
        if not records:  # Accelerate's deepspeed_plugin.deepspeed_config shows the first engine's configuration
            built.config = options.adopt_engine_config(built.config)
        placeholder = bool(schedulers) and isinstance(schedulers[0], DummyScheduler)
        if built.builds_optimizer and schedulers and not placeholder:
            raise DeepSpeedStrategyError(
                f"deepspeed: the DeepSpeed config builds the optimizer ('optimizer' block), so a scheduler over the "
                f"script's {type(optimizer).__name__} would not drive it; use a 'scheduler' block in the DeepSpeed "
                "config, or remove the 'optimizer' block to train with the script's optimizer")
        assert run.device is not None
        if device_placement:
            model.to(run.device.device)
        _mark_leaf_modules(deepspeed, model, options.deepspeed_moe_layer_cls_names)
        kwargs: dict[str, Any] = {"model": model, "config": built.config}
        if built.builds_optimizer:
            kwargs["model_parameters"] = _parameter_groups(model, optimizer)
        elif optimizer is not None:
            kwargs["optimizer"] = optimizer
        if built.scheduler_callable is not None:
            kwargs["lr_scheduler"] = built.scheduler_callable
        try:
            with watching_jit_builds(deepspeed, rank=run.cluster.rank, local_rank=run.cluster.local_rank,
                                     patience=options.jit_lock_warning_seconds):
                engine, _, _, _ = deepspeed.initialize(**kwargs)
        except AssertionError as exc:  # DeepSpeed reports configuration problems as assertions
            raise DeepSpeedStrategyError(f"deepspeed.initialize refused the configuration of model #{len(records)} "
                                         f"({type(model).__name__}): {exc}") from exc
        handed_back = getattr(engine, "basic_optimizer", None) if (optimizer is not None or built.builds_optimizer) \
            else None
        record = EngineRecord(index=len(records), engine=engine, module=engine.module,
                              params=frozenset(id(p) for p in engine.module.parameters() if p.requires_grad),
                              optimizer=handed_back, built=built)
        records.append(record)
        _cast_at_the_boundary(engine)
        prepared_schedulers = [EngineBuiltScheduler(engine.lr_scheduler, handed_back)] if placeholder else list(schedulers)
        return PreparedModel(model=engine, unwrapped=engine.module,
                             optimizers=[handed_back] if optimizers else [], schedulers=prepared_schedulers)

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
        records = [r for r in (_record_of_optimizer(run, o) for o in optimizers) if r is not None]
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
            record = _record_of_loss(records, loss)
            if record is None:  # the loss reaches no prepared model's trainable parameters
                loss.backward(**kwargs)
                return
            record.engine.set_gradient_accumulation_boundary(state.sync_gradients)
            record.engine.backward(loss, **kwargs)

        def optimizer_step(optimizer: Any) -> bool:
            record = _record_of_optimizer(run, optimizer)
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
            return _clip_grad_norm(run, records, parameters, max_norm, norm_type)

        plan.set("backward", backward)
        plan.set("optimizer_step", optimizer_step)
        plan.set("zero_grad", _engine_zeroes)
        plan.set("unscale_gradients", _engine_unscales)
        plan.set("clip_grad_norm", clip_grad_norm)
        plan.set("clip_grad_value", _no_value_clipping)
        plan.set("no_sync", _engine_accumulates)

    # -- checkpoints -------------------------------------------------------------------------------

    @hookimpl
    def torchrig_save_strategy_state(self, run: RunContext, prepared: Sequence[PreparedModel], directory: str) -> list[str]:
        return ds_checkpoint.save_state(run, _records_for(run, prepared), directory)

    @hookimpl
    def torchrig_load_strategy_state(self, run: RunContext, prepared: Sequence[PreparedModel], directory: str,
                                     manifest: Any, allow_pickle: bool) -> bool:
        ds_checkpoint.load_state(run, _records_for(run, prepared), directory, manifest, allow_pickle)
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


def _no_value_clipping(parameters: Any, clip_value: float) -> None:
    raise DeepSpeedStrategyError(
        "deepspeed: clip_grad_value_ is not supported: DeepSpeed clips the global gradient norm inside its step; use "
        "clip_grad_norm_(parameters, max_norm) or set deepspeed_config.gradient_clipping")


def _record_of_optimizer(run: RunContext, optimizer: Any) -> EngineRecord | None:
    """The engine of an optimizer ``prepare`` handed back (or of the prepared wrapper around it)."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        for record in engines_of(run):
            if record.optimizer is not None and candidate is not None and (
                    candidate is record.optimizer or candidate is record.engine.optimizer):
                return record
    return None


def _record_of_loss(records: Sequence[EngineRecord], loss: torch.Tensor) -> EngineRecord | None:
    trainable = [r for r in records if r.optimizer is not None]
    if len(trainable) == 1:
        return trainable[0]
    if not trainable:
        return None
    found = _engines_in_graph(trainable, loss)
    if len(found) == 1:
        return found[0]
    if not found:
        return None
    names = ", ".join(f"#{r.index} ({type(r.module).__name__})" for r in found)
    raise DeepSpeedStrategyError(
        f"deepspeed: this loss depends on the trainable parameters of models {names}, each its own DeepSpeed engine; "
        "one backward goes to one engine. Freeze the model that should not learn from it "
        "(model.requires_grad_(False) around that forward) or detach its output, and backward each model's loss "
        "separately")


def _engines_in_graph(records: Sequence[EngineRecord], loss: torch.Tensor) -> list[EngineRecord]:
    """The engines whose trainable parameters the loss's autograd graph reaches (its leaves)."""
    owner = {pid: record for record in records for pid in record.params}
    found: dict[int, EngineRecord] = {}
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            record = owner.get(id(variable))
            if record is not None:
                found[record.index] = record
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return [found[i] for i in sorted(found)]


def _records_for(run: RunContext, prepared: Sequence[PreparedModel]) -> list[EngineRecord]:
    records = []
    for item in prepared:
        record = record_of_module(run, item.unwrapped)
        if record is None:
            raise DeepSpeedStrategyError(f"deepspeed: {type(item.unwrapped).__name__} was not prepared by the deepspeed "
                                         "strategy of this Accelerator")
        records.append(record)
    return records


# -- clipping -------------------------------------------------------------------------------------------


def _clip_grad_norm(run: RunContext, records: Sequence[EngineRecord], parameters: Any, max_norm: float,
                    norm_type: float) -> torch.Tensor:
    """DeepSpeed clips inside ``engine.step`` to the engine's ``gradient_clipping``: make that
    ``max_norm`` (when no configuration fixed another value) and return the global 2-norm of the
    gradients the coming step will clip (on a micro-step that does not step: the last step's)."""
    if float(norm_type) != 2.0:
        raise DeepSpeedStrategyError(f"deepspeed: clip_grad_norm_(norm_type={norm_type}) is not supported: DeepSpeed "
                                     "clips the global 2-norm; call it with norm_type=2")
    wanted = {id(p) for p in ([parameters] if isinstance(parameters, torch.Tensor) else parameters)}
    chosen = [r for r in records if r.params & wanted]
    if not chosen:
        raise DeepSpeedStrategyError("deepspeed: clip_grad_norm_ got no trainable parameter of a prepared model; pass "
                                     "model.parameters() of the prepared model")
    squares = 0.0
    for record in chosen:
        _apply_clipping(run, record, float(max_norm))
        squares += float(grad_norm(record)) ** 2
    return torch.tensor(squares ** 0.5)


def _apply_clipping(run: RunContext, record: EngineRecord, max_norm: float) -> None:
    engine = record.engine
    current = float(engine.gradient_clipping() or 0.0)
    if current == max_norm:
        return
    if not record.built.clipping_open:
        where = run.config.source(f"{SECTION}.gradient_clipping") if hasattr(run.config, "source") else None
        origin = f"deepspeed_config.gradient_clipping ({where})" if run.option(f"{SECTION}.gradient_clipping") \
            is not None else "the DeepSpeed config's gradient_clipping"
        raise DeepSpeedStrategyError(
            f"deepspeed: clip_grad_norm_(max_norm={max_norm:g}) but the engine clips at {current:g}, set by {origin}; "
            "DeepSpeed clips inside its step with one value, so make them agree (or remove one)")
    engine._config.gradient_clipping = max_norm
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = max_norm
    record.built.config["gradient_clipping"] = max_norm


def grad_norm(record: EngineRecord) -> float:
    """The global 2-norm of the engine's current (unscaled) gradients, with one collective.

    ZeRO-3 and ZeRO-1/2 (and DeepSpeed's bf16 optimizer) hold each rank's slice of every
    gradient: the squares of the slices are summed over the data-parallel group. Stage 0 keeps
    whole, already reduced gradients on every rank. Between boundaries gradients are not reduced
    yet: the norm of the last applied step is returned then."""
    import torch.distributed as dist

    engine = record.engine
    if not engine.is_gradient_accumulation_boundary():
        return float(engine.get_global_grad_norm() or 0.0)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    local = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    group = None
    if engine.zero_optimization_partition_weights():
        from deepspeed.utils import safe_get_local_grad

        for p in params:
            grad = safe_get_local_grad(p)
            if grad is not None:
                local += grad.detach().double().pow(2).sum().cpu()
        group = engine.optimizer.dp_process_group
    else:
        for p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if p.grad is not None and mapping is None and getattr(p, "_hp_grad", None) is None:
                replicated += p.grad.detach().double().pow(2).sum().cpu()
            elif hasattr(p, "_dp_group"):
                group = p._dp_group
                if mapping is not None:
                    local += _fragment(p, mapping).double().pow(2).sum().cpu()
    if group is not None and dist.is_initialized():
        # the sums are on the CPU (offloaded gradients, or .cpu() above); the group's backend takes
        # tensors of the run's device (NCCL: CUDA only)
        summed = local.to(engine.device)
        dist.all_reduce(summed, group=group)
        local = summed.cpu()
    scale = float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0) if engine.fp16_enabled() else 1.0
    return float((local + replicated).sqrt()) / scale


def _fragment(param: Any, mapping: Any) -> torch.Tensor:
    """This rank's slice of ``param``'s gradient (what DeepSpeed's ``get_full_hp_grad`` sums
    over ranks, without gathering the rest)."""
    fragment = mapping.get_lp_grad_fragment(param._index_in_param_group).detach().float().flatten()
    address = mapping.lp_fragment_address
    if fragment.numel() == param.numel() and address.numel != param.numel():
        fragment = fragment.narrow(0, address.start, address.numel)  # bf16: a full buffer per rank
    return fragment


# -- preparation helpers ---------------------------------------------------------------------------


def _import_deepspeed(run: RunContext) -> Any:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    assert run.device is not None
    want = run.device.device.type
    have = get_accelerator().device_name()
    if (want == "cpu") != (have == "cpu"):
        raise DeepSpeedStrategyError(
            f"deepspeed: this run uses the {want} device but DeepSpeed chose its {have!r} accelerator when it was "
            f"imported; set DS_ACCELERATOR={'cpu' if want == 'cpu' else 'cuda'} in the environment before starting "
            "(torchrig launch sets it on machines without a GPU)")
    return deepspeed


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


def _parameter_groups(model: Any, optimizer: Any) -> list[Any]:
    """Parameters for an optimizer DeepSpeed builds from the JSON: the script's optimizer's
    groups (only their weight decay when it differs between groups: the JSON's hyperparameters
    apply), or the model's trainable parameters."""
    if optimizer is None:
        return [p for p in model.parameters() if p.requires_grad]
    groups = optimizer.param_groups
    decays = {g.get("weight_decay") for g in groups}
    return [{"params": g["params"], **({"weight_decay": g["weight_decay"]} if len(decays) > 1 else {})} for g in groups]


def _mark_leaf_modules(deepspeed: Any, model: Any, names: Iterable[str] | None) -> None:
    """``deepspeed_moe_layer_cls_names``: ZeRO-3 gathers these modules whole (MoE blocks, whose
    experts run data-dependently)."""
    if not names:
        return
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise DeepSpeedStrategyError(
            f"{SECTION}.deepspeed_moe_layer_cls_names: no module of class {', '.join(repr(n) for n in missing)} in "
            f"{type(model).__name__}; its module classes are: {', '.join(sorted(present))}")
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, [present[n] for n in names])


def _cast_at_the_boundary(engine: Any) -> None:
    """bf16/fp16 engines hold low-precision parameters: floating-point inputs are cast to that
    dtype on the way in and floating-point outputs to fp32 on the way out, as the precision
    plugins' autocast does, so the same script runs under every strategy."""
    if engine.bfloat16_enabled():
        dtype = torch.bfloat16
    elif engine.fp16_enabled():
        dtype = torch.float16
    else:
        return

    def cast(value: Any, to: torch.dtype) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(to) if value.is_floating_point() and value.dtype != to else value
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(cast(v, to) for v in value)
        if isinstance(value, dict) and type(value) is dict:
            return {k: cast(v, to) for k, v in value.items()}
        return value

    def inputs(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return cast(args, dtype), cast(kwargs, dtype)

    def outputs(module: Any, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return cast(output, torch.float32)
        if hasattr(output, "items") and hasattr(output, "__setitem__") and type(output) is not dict:
            for key in list(output.keys()):  # Hugging Face ModelOutput: keep its class
                output[key] = cast(output[key], torch.float32)
            return output
        return cast(output, torch.float32)

    engine.module.register_forward_pre_hook(inputs, with_kwargs=True)
    engine.module.register_forward_hook(outputs)


__all__ = ["ENGINES", "DeepSpeedStrategy", "DeepSpeedStrategyError", "EngineRecord", "EngineScheduler",
           "deepspeed_options", "grad_norm"]
