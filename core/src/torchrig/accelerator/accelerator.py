"""``Accelerator``: the user-facing object, with Hugging Face Accelerate's names.

The Accelerator reads the configuration itself — the machine's default file, the run's config
file (``TORCHRIG_CONFIG_FILE``), ``TORCHRIG_*`` variables and the flags ``torchrig launch``
passes on — so ``python train.py``, ``torchrun train.py`` and ``torchrig launch train.py`` agree.
Its own arguments sit between the machine's default file and the run's file in precedence
(see :mod:`torchrig.config.resolve`). Configuration is validated, with the script's arguments
merged, before any process group is created, so a bad configuration fails on every rank with
the same message.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from torchrig.accelerator.arguments import accelerator_arguments
from torchrig.accelerator.checkpoints import CheckpointCalls
from torchrig.accelerator.collectives import CollectiveCalls
from torchrig.accelerator.context_parallel import context_parallel
from torchrig.accelerator.observers import prepare_returned, prepare_started
from torchrig.accelerator.preemption import PreemptionCalls
from torchrig.accelerator.profiling import profile_options, profile_run
from torchrig.accelerator.step import StepCalls
from torchrig.accelerator.step_contexts import AccumulateContext
from torchrig.accelerator.tracking import TrackingCalls
from torchrig.checkpoint.ledger import CheckpointLedger
from torchrig.compat.enums import RNGType
from torchrig.config.options import ProfileKwargs, TrainingGuardConfig
from torchrig.config.resolve import ResolvedConfig, Schema
from torchrig.data import standalone as standalone_data
from torchrig.defaults import training as training_defaults
from torchrig.distributed.nested import convert_to_fp32
from torchrig.distributed.process import AcceleratorState
from torchrig.errors import ConfigError
from torchrig.host.plugin_host import PluginHost
from torchrig.host.run import RunContext
from torchrig.host.runtime import build_step_plan, declared_precision_type, end_run, open_run
from torchrig.optimizer import AcceleratedOptimizer
from torchrig.plugin.types import Capabilities, PreparedModel
from torchrig.resilience.training_guard import TrainingGuard
from torchrig.tracking.hub import TrackerHub
from torchrig.training.compile import compile_model
from torchrig.training.compile_check import CompileVerifier
from torchrig.training.conversion import convert_model
from torchrig.training.gradient_state import gradient_state_of
from torchrig.training.step_plan import StepPlan
from torchrig.training.token_loss import TokenCountWindow
from torchrig.training.unprepared import UnpreparedParameterCheck


class Accelerator(StepCalls, CheckpointCalls, TrackingCalls, CollectiveCalls, PreemptionCalls):
    """Run one training script on one process or many, under the configured strategy.

    Arguments follow Hugging Face Accelerate's; ``strategy``, ``config_file`` and
    ``strict_config`` are torchrig's own.
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: Any = None,
        deepspeed_plugin: Any = None,
        fsdp_plugin: Any = None,
        torch_tp_plugin: Any = None,
        megatron_lm_plugin: Any = None,
        rng_types: Sequence[str] | None = None,
        log_with: Any = None,
        project_dir: str | os.PathLike | None = None,
        project_config: Any = None,
        gradient_accumulation_plugin: Any = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: Sequence[Any] | None = None,
        dynamo_backend: Any = None,
        dynamo_plugin: Any = None,
        deepspeed_plugins: Any = None,
        parallelism_config: Any = None,
        *,
        strategy: str | None = None,
        config_file: str | os.PathLike | None = None,
        strict_config: bool | None = None,
    ) -> None:
        self.device_placement = device_placement
        self.rng_types = RNGType.parse_all(rng_types, "Accelerator(rng_types=...)")
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self._host = PluginHost()
        training_defaults.register(self._host)
        schema = Schema(self._host)
        arguments = accelerator_arguments(
            schema,
            split_batches=split_batches,
            mixed_precision=mixed_precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            cpu=cpu,
            dataloader_config=dataloader_config,
            deepspeed_plugin=deepspeed_plugin,
            fsdp_plugin=fsdp_plugin,
            torch_tp_plugin=torch_tp_plugin,
            megatron_lm_plugin=megatron_lm_plugin,
            log_with=log_with,
            project_dir=project_dir,
            project_config=project_config,
            gradient_accumulation_plugin=gradient_accumulation_plugin,
            kwargs_handlers=kwargs_handlers,
            dynamo_backend=dynamo_backend,
            dynamo_plugin=dynamo_plugin,
            deepspeed_plugins=deepspeed_plugins,
            parallelism_config=parallelism_config,
            strategy=strategy,
            strict_config=strict_config,
        )
        self._run: RunContext = open_run(self._host, arguments, config_file)
        self.config: ResolvedConfig = self._run.config  # type: ignore[assignment]
        self.gradient_state = gradient_state_of(self._run)
        self._configure_accumulation()
        self._plan: StepPlan | None = None
        self._token_window = TokenCountWindow()
        self._step_token_count: int | None = None
        #: The plan as the plugins built it (its GradScaler included), before the accelerator's own
        #: wrappers: a check leaving the plan re-wraps this one, never a new build (a new GradScaler
        #: between a scaled backward and its step would have no scale).
        self._base_plan: StepPlan | None = None
        self._plan_generation = -1
        self._unprepared = UnpreparedParameterCheck(
            live_param_ids=self._prepared_param_ids, syncing=lambda: self.gradient_state.sync_gradients,
            data_parallel_size=lambda: getattr(self._run.capabilities, "data_parallel_size", None),
            on_done=self._rewrap_plan)
        #: What is prepared and registered, in order: appended to here, read by the checkpoints.
        self._ledger = CheckpointLedger(self._run, self.gradient_state)
        self._models: list[PreparedModel] = self._ledger.models
        #: Parameters a strategy replaced at prepare (id → weak reference, model class): an
        #: optimizer prepared later over them is refused.
        self._replaced_params: dict[int, tuple[Any, str]] = {}
        self._optimizers: list[AcceleratedOptimizer] = self._ledger.optimizers
        self._schedulers: list[Any] = self._ledger.schedulers
        self._dataloaders: list[Any] = self._ledger.dataloaders
        self._accumulate = AccumulateContext(self)
        self.flag_tensor: Any = None
        self._trackers = TrackerHub(self._run)
        self._preemption = self._arm_preemption()
        self._throughput = self._arm_throughput()
        guard_options = self._run.section(TrainingGuardConfig)
        #: The training guard (``training_guard`` config), None when off: then the plan is not wrapped.
        self._training_guard = TrainingGuard(
            guard_options, device=self.device, log=self.log, latest_checkpoint=self.latest_checkpoint,
            dataloaders=self._dataloaders, active_dataloaders=self.gradient_state.active_dataloaders,
        ) if guard_options.enabled else None
        if self._training_guard is not None and self._training_guard.rolls_back:  # resume without skipped batches
            self.register_load_state_pre_hook(self._training_guard.resume_without_skipped_batches)
        dynamo = self.config.section("dynamo_config")
        self._compile_check = CompileVerifier(on_done=self._rewrap_plan, check_after_steps=dynamo.check_after_steps,
                                              recompile_warn_threshold=dynamo.recompile_warn_threshold)

    def _configure_accumulation(self) -> None:
        """Gradient accumulation settings: ``GradientAccumulationPlugin``, then the fields a
        ``DataLoaderConfiguration(gradient_accumulation_kwargs=...)`` gives (the seed's API)."""
        plugin = self.config.section("gradient_accumulation_plugin")
        configured = plugin.num_steps if (plugin.num_steps is not None and not self.config.is_set("gradient_accumulation_steps")) \
            else self.config["gradient_accumulation_steps"]
        settings = {"num_steps": configured, "adjust_scheduler": plugin.adjust_scheduler,
                    "sync_with_dataloader": plugin.sync_with_dataloader, "sync_each_batch": plugin.sync_each_batch}
        extra = self.config["dataloader_config.gradient_accumulation_kwargs"] or {}
        unknown = sorted(set(extra) - set(settings))
        if unknown:
            raise ConfigError([f"dataloader_config.gradient_accumulation_kwargs.{key} ({self.config.source('dataloader_config.gradient_accumulation_kwargs')}): "
                               f"unknown key; accepted: {', '.join(settings)}" for key in unknown])
        settings.update(extra)
        state = self.gradient_state
        state.num_steps = int(settings["num_steps"])
        state.adjust_scheduler = bool(settings["adjust_scheduler"])
        state.sync_with_dataloader = bool(settings["sync_with_dataloader"])
        state.sync_each_batch = bool(settings["sync_each_batch"])
        state.step_scheduler_with_optimizer = self.step_scheduler_with_optimizer

    # -- what was configured (where this process sits: ProcessControl) -------------------

    @property
    def strategy(self) -> str:
        """The strategy plugin in use (``single``, ``ddp``, ``fsdp``, ``deepspeed``...)."""
        return str(self.config["strategy"])

    @property
    def mixed_precision(self) -> str:
        """Accelerate's name for the precision (``"no"``, ``"fp16"``, ``"bf16"``), as the precision
        plugin declares it; equal to the ``PrecisionType`` members."""
        return declared_precision_type(self._run)

    @property
    def scaler(self) -> Any:
        """The GradScaler the training step goes through (fp16), or None when nothing scales the loss —
        Accelerate's attribute, which scripts read to log the loss scale."""
        return self._step_plan().loss_scaler

    @property
    def state(self) -> AcceleratorState:
        """Accelerate's ``AcceleratorState`` view of this run."""
        return AcceleratorState._of(self._run)

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        """Settable mid-run as in Accelerate: its ``automatic_gradient_accumulation`` example recomputes the steps
        for each batch size ``find_executable_batch_size`` tries."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"gradient_accumulation_steps must be a positive int, got {steps!r}")
        self.gradient_state.num_steps = steps

    @property
    def project_dir(self) -> str | None:
        return self.config["project_config.project_dir"]

    @property
    def logging_dir(self) -> str | None:
        logging_dir, project_dir = self.config["project_config.logging_dir"], self.project_dir
        if logging_dir is None:
            return project_dir
        return os.path.join(project_dir, logging_dir) if project_dir else logging_dir

    def end_training(self) -> dict[str, dict[str, Any]]:
        """Finish every tracker (each waited for at most its ``wait_timeout``); returns this
        process's report ``{tracker: {state, delivered, dropped, errors, ...}}``, also recorded
        in the rank's status file. Call on every rank. Also waits for an asynchronous checkpoint
        save to commit, and raises its failure. Then the run ends: plugins get
        ``torchrig_unconfigure`` (once; at interpreter exit instead when this is never called)."""
        report = self._trackers.finish()
        self._compile_check.close()
        self._wait_for_checkpoint()
        end_run(self._run)
        return report

    # -- preparation ----------------------------------------------------------------------

    def prepare(self, *args: Any, device_placement: Sequence[bool] | None = None) -> Any:
        """Prepare models, optimizers, dataloaders and schedulers, in any order and number.

        Each model is prepared together with the optimizers over its parameters (and the
        schedulers of those optimizers) by the strategy; dataloaders are sharded and placed on
        the device. Returns the objects in the order given (a single object unwrapped).
        """
        import torch
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass

        if device_placement is not None and len(device_placement) != len(args):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(args)} objects")
        placement = list(device_placement) if device_placement is not None else [self.device_placement] * len(args)
        prepare_started(self, args)
        result: list[Any] = list(args)
        models = [i for i, a in enumerate(args) if isinstance(a, torch.nn.Module)]
        # A prepared optimizer is a torch Optimizer too (as Accelerate's is): returned as it is, never wrapped twice.
        optimizers = [i for i, a in enumerate(args)
                      if isinstance(a, torch.optim.Optimizer) and not isinstance(a, AcceleratedOptimizer)]
        schedulers = [i for i, a in enumerate(args) if _is_scheduler(a)]
        loaders = [i for i, a in enumerate(args) if isinstance(a, torch.utils.data.DataLoader)]
        self._step_plan()  # built before the strategy prepares (compile then rebuilds it)
        caps = self._run.capabilities
        assert caps is not None
        self.gradient_state.adopt_strategy_steps(caps.accumulation_steps,
                                                 configured=self.config.is_set("gradient_accumulation_steps"))

        claimed: set[int] = set()
        for m in models:
            model = args[m]
            params = {id(p) for p in model.parameters()}
            own = [o for o in optimizers if o not in claimed and _optimizer_params(args[o]) & params]
            for o in own:
                if not _optimizer_params(args[o]) <= params:
                    raise ValueError(f"prepare(): optimizer #{o} holds parameters of {type(model).__name__} and "
                                     "others that are not its (another model's, or a tensor outside any model such "
                                     "as a learnable loss scale); give each model its own optimizer, and register "
                                     "a parameter outside the model on the model (or in an optimizer of its own)")
            claimed.update(own)
            own_schedulers = [s for s in schedulers if any(args[s].optimizer is args[o] for o in own)]
            convert_model(self._host, self._run, model, [args[o] for o in own])  # fp8: before sharding/compile
            # No weak reference to a tensor-subclass parameter (fp8 weights): module.to() swaps those
            # with torch.utils.swap_tensors, which refuses a tensor that has one.
            originals = {id(p): (weakref.ref(p), type(model).__name__) for p in model.parameters()
                         if not is_traceable_wrapper_subclass(p)}
            prepared = self._host.hook.torchrig_prepare_model(
                run=self._run, model=model, optimizers=[args[o] for o in own],
                schedulers=[args[s] for s in own_schedulers], device_placement=placement[m],
            )
            live = _live_param_ids(prepared)
            self._replaced_params.update((i, ref) for i, ref in originals.items() if i not in live)
            prepared.model = self._apply_precision_and_compile(prepared.model)
            self._models.append(prepared)
            result[m] = prepared.model
            for o, optimizer in zip(own, prepared.optimizers):
                result[o] = self._wrap_optimizer(optimizer, self._step_plan())
            for s, scheduler in zip(own_schedulers, prepared.schedulers):
                result[s] = scheduler
        for o in optimizers:
            if o not in claimed:
                self._check_late_optimizer(args[o])
                result[o] = self._wrap_optimizer(args[o], self._step_plan())
        # A strategy may hand back another optimizer than the one given (DeepSpeed builds its own
        # in place of a placeholder): a scheduler follows what its optimizer became.
        became = {id(args[o]): result[o] for o in optimizers}
        for s in schedulers:
            optimizer = became.get(id(args[s].optimizer)) or next(
                (w for w in self._optimizers if args[s].optimizer is w or args[s].optimizer is w.optimizer), None)
            if optimizer is None:
                raise ValueError("prepare(): a scheduler's optimizer must be prepared with it or before it")
            wrapped = self._host.hook.torchrig_prepare_scheduler(run=self._run, scheduler=result[s], optimizers=[optimizer])
            self._schedulers.append(wrapped)
            result[s] = wrapped
        for d in loaders:
            loader = self._host.hook.torchrig_prepare_dataloader(run=self._run, dataloader=args[d],
                                                                 device_placement=placement[d])
            self._dataloaders.append(loader)
            result[d] = loader
        prepare_returned(self, args, tuple(result))
        return result[0] if len(result) == 1 else tuple(result)

    def prepare_model(self, model: Any, device_placement: bool | None = None, evaluation_mode: bool = False) -> Any:
        return self.prepare(model, device_placement=None if device_placement is None else [device_placement])

    def prepare_optimizer(self, optimizer: Any, device_placement: bool | None = None) -> Any:
        return self.prepare(optimizer)

    def prepare_scheduler(self, scheduler: Any) -> Any:
        return self.prepare(scheduler)

    def prepare_data_loader(self, data_loader: Any, device_placement: bool | None = None) -> Any:
        return self.prepare(data_loader, device_placement=None if device_placement is None else [device_placement])

    def _step_plan(self) -> StepPlan:
        if self._plan is None or self._plan_generation != self._host.generation:
            if self._base_plan is None or self._plan_generation != self._host.generation:
                self._base_plan = build_step_plan(self._host, self._run)
            self._plan = self._base_plan
            if self._preemption is not None:  # count optimizer steps: a preemption stops only after one
                self._plan = attrs.evolve(self._plan, optimizer_step=self._preemption.wrap_optimizer_step(
                    self._plan.optimizer_step))
            if self._throughput.active:  # count optimizer steps, measure every log_every_n_steps
                self._plan = attrs.evolve(self._plan, optimizer_step=self._throughput.wrap_optimizer_step(
                    self._plan.optimizer_step))
            if self._compile_check.active:  # the compile verdict after the first steps, then out of the plan
                self._plan = attrs.evolve(self._plan, optimizer_step=self._compile_check.wrap_optimizer_step(
                    self._plan.optimizer_step))
            if self._training_guard is not None:  # agree on each step's loss and gradient norm; skip or stop
                self._training_guard.check_supported(self.strategy, self._run.capabilities, self._plan)
                self._plan = self._training_guard.wrap_plan(self._plan)
            if self._unprepared.active:  # once: gradients of parameters outside every prepared model
                self._plan = self._unprepared.wrap_plan(self._plan)
            self._plan_generation = self._host.generation
            for optimizer in self._optimizers:
                optimizer.plan = self._plan
        return self._plan

    def _prepared_param_ids(self) -> set[int]:
        return set().union(*(_live_param_ids(prepared) for prepared in self._models))

    def _replan(self) -> None:
        """Build the step plan anew (the plugins' part included): after a change the plugins read."""
        self._base_plan = None
        self._rewrap_plan()

    def _rewrap_plan(self) -> None:
        """Re-apply the accelerator's own wrappers to the plan the plugins built: a check that has
        looked leaves the plan this way, keeping the plan's stateful parts (its GradScaler)."""
        self._plan = None
        self._step_plan()

    def compile_report(self) -> dict[str, Any]:
        """Whether ``torch.compile`` took effect: per compiled module or region {compiled, calls,
        frames, graphs, graph_breaks, recompiles} over the first steps, and the recompilations since."""
        return self._compile_check.report()

    @property
    def step_plan(self) -> StepPlan:
        """The callables the training step runs, and which plugin owns each (``plan.owners``)."""
        return self._step_plan()

    def _wrap_optimizer(self, optimizer: Any, plan: StepPlan) -> AcceleratedOptimizer:
        assert self._run.capabilities is not None
        wrapped = AcceleratedOptimizer(optimizer, plan, self.gradient_state,
                                       owns_accumulation=self._run.capabilities.owns_accumulation)
        self._optimizers.append(wrapped)
        return wrapped

    def _check_late_optimizer(self, optimizer: Any) -> None:
        """An optimizer prepared after its model must still hold the model's live parameters
        (a sharding strategy replaces them: then model and optimizer go in one prepare call).
        Stepping one that holds replaced parameters would silently train nothing."""
        for group in optimizer.param_groups:
            for param in group["params"]:
                ref, owner = self._replaced_params.get(id(param), (None, ""))
                if ref is not None and ref() is param:  # the same object, not a reused id
                    raise ValueError(
                        f"prepare(): this {type(optimizer).__name__} holds the parameters {owner} had before it was "
                        f"prepared, and the {self.config.get('strategy')!r} strategy replaced them (sharding), so "
                        "stepping it would train nothing. Prepare the model and its optimizer in one call "
                        "(accelerator.prepare(model, optimizer)), or build the optimizer from the prepared model's "
                        "parameters")
        held = _optimizer_params(optimizer)
        for prepared in self._models:
            live = _live_param_ids(prepared)
            if held & live and not held <= live:
                raise ValueError("prepare(): this optimizer was built over parameters its model no longer uses (the "
                                 "strategy replaced them); prepare the model and its optimizer in one call")

    def _apply_precision_and_compile(self, model: Any) -> Any:
        """Autocast the forward (when the precision plugin installed one) and ``torch.compile``
        after the strategy wrapped the model."""
        plan = self._step_plan()
        if plan.owners["autocast"] != "core":
            forward = model.forward
            autocast = plan.autocast

            @functools.wraps(forward)
            def autocast_forward(*args: Any, **kwargs: Any) -> Any:
                with autocast():
                    return convert_to_fp32(forward(*args, **kwargs))

            model._torchrig_original_forward = forward
            model.forward = autocast_forward
        dynamo = self.config.section("dynamo_config")
        if dynamo.backend != "no" and not dynamo.disable:
            model = compile_model(model, dynamo)
            self._compile_check.watch(model, type(getattr(model, "_orig_mod", model)).__name__)
            self._replan()
        return model

    # -- the mesh the strategy built ----------------------------------------------------------

    @property
    def torch_device_mesh(self) -> Any:
        """The run's ``DeviceMesh`` when the strategy built one (``parallelism_config``; named axes
        ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``), else None (Accelerate's name)."""
        return self.strategy_capabilities.device_mesh

    @property
    def device_submeshes(self) -> Mapping[str, Any]:
        """Named sub-meshes of ``torch_device_mesh``: each axis and the flattened ``dp``,
        ``dp_shard_cp``, ``dp_cp`` (torch warns when those are sliced from the root mesh)."""
        return self.strategy_capabilities.device_submeshes

    def maybe_context_parallel(self, buffers: Sequence[Any] | None = None, buffer_seq_dims: Sequence[int] | None = None,
                               no_restore_buffers: Sequence[Any] | None = None) -> Any:
        """Context parallel around forward and backward (Accelerate's name): shards ``buffers`` over the
        ``cp`` axis along ``buffer_seq_dims`` and runs SDPA as ring attention; a no-op without a ``cp``
        axis. Refuses what it would compute wrongly (:mod:`torchrig.accelerator.context_parallel`)."""
        cp = self.device_submeshes.get("cp")
        if cp is None or cp.size() == 1:
            return contextlib.nullcontext()
        options = self.config.section("parallelism_config")
        return context_parallel(cp, buffers or [], buffer_seq_dims or [], no_restore_buffers or [],
                                comm_strategy=options.cp_comm_strategy, load_balance=options.cp_load_balance,
                                planning=self._run.planning)

    @property
    def strategy_capabilities(self) -> Capabilities:
        """What the selected strategy declared it owns (:class:`torchrig.plugin.types.Capabilities`)."""
        self._step_plan()
        assert self._run.capabilities is not None
        return self._run.capabilities

    def profile(self, profile_handler: ProfileKwargs | None = None) -> Any:
        """Context manager yielding a ``torch.profiler.profile`` configured by ``profile_handler`` (default:
        the run's ``ProfileKwargs``); the trace goes to ``output_trace_dir/profile_{process_index}.json``."""
        return profile_run(self, profile_handler if profile_handler is not None else profile_options(self.config))

    def wait_for_everyone(self) -> None:
        """Barrier; also where a failed asynchronous checkpoint save is raised (every rank)."""
        self._wait_for_checkpoint()
        super().wait_for_everyone()

    # -- models -------------------------------------------------------------------------------

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        """The user's own module behind a prepared (wrapped, compiled, autocast) model."""
        for prepared in self._models:
            if model is prepared.model or model is prepared.unwrapped:
                unwrapped = prepared.unwrapped
                break
        else:
            unwrapped = getattr(model, "_orig_mod", model)
        if not keep_fp32_wrapper and hasattr(unwrapped, "_torchrig_original_forward"):
            unwrapped.forward = unwrapped._torchrig_original_forward
            del unwrapped._torchrig_original_forward
        return unwrapped

    def get_state_dict(self, model: Any, unwrap: bool = True) -> dict[str, Any]:
        """The full state dict (gathered from shards when sharded; on the main process)."""
        for prepared in self._models:
            if model is prepared.model or model is prepared.unwrapped:
                return self._host.hook.torchrig_full_state_dict(run=self._run, prepared=prepared)
        return self.unwrap_model(model).state_dict()

    def free_memory(self, *objects: Any) -> list[None]:
        """Forget every prepared object, collect garbage and empty the device cache."""
        self._ledger.forget_prepared()
        gc.collect()
        if self._run.device is not None:
            self._run.device.empty_cache()
        return [None for _ in objects]

    clear = free_memory

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: Sequence[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Train on inputs of different lengths per rank: ranks that run out of data keep
        shadowing the others' collectives (``torch.distributed.algorithms.Join``) instead of
        hanging them. ``joinables`` are prepared models (a DDP module is joinable) or other
        ``Joinable`` objects; ``even_batches`` temporarily overrides the prepared dataloaders'
        padding (False lets ranks see different numbers of batches)."""
        if self.num_processes <= 1:
            yield
            return
        from torch.distributed.algorithms import Join, Joinable

        not_joinable = [type(j).__name__ for j in joinables if not isinstance(j, Joinable)]
        if not_joinable:
            raise TypeError(f"join_uneven_inputs: {', '.join(not_joinable)} cannot join uneven inputs (not a "
                            f"torch Joinable); the {self.strategy!r} strategy's prepared models may not support it")
        saved = [(loader, loader.even_batches) for loader in self._dataloaders if hasattr(loader, "even_batches")]
        try:
            if even_batches is not None:
                for loader, _ in saved:
                    loader.even_batches = even_batches
            with Join(list(joinables)):
                yield
        finally:
            for loader, value in saved:
                loader.even_batches = value

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        return standalone_data.skip_first_batches(dataloader, num_batches)



def _live_param_ids(prepared: PreparedModel) -> set[int]:
    """Ids of the parameters a prepared model trains (its wrapper's and its own module's)."""
    return {id(p) for p in prepared.model.parameters()} | {id(p) for p in prepared.unwrapped.parameters()}


def _optimizer_params(optimizer: Any) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _is_scheduler(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "get_last_lr")
    )


__all__ = ["Accelerator"]
