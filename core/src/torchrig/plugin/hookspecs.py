"""The hook contract between torchrig's core and its plugins.

This module is the API reference for plugin authors. Every hook is documented with

* **phase** – when it is called;
* **ranks** – which processes call it;
* **kind** – ``firstresult`` (the first non-``None`` answer wins; the core registers exactly one
  ``trylast`` default, so "nobody answered" cannot happen), ``collecting`` (every
  implementation is called, non-``None`` results are returned as a list) or ``historic``
  (remembered and replayed to plugins registered later);
* **arguments** and **return**;
* **default** – what the core does when no plugin answers.

Design rules the hooks follow (see docs/architecture.md):

* **Hooks decide; the step path runs plain callables.** Nothing in this module is called per
  training step. At ``prepare`` the core asks the step-plan hooks once and the hot path calls
  the resulting plain callables (a pluggy call costs ~1.7 µs; the per-step budget is 25 µs).
* **Capabilities are negotiated, not guessed.** The strategy declares what it owns
  (:class:`~torchrig.plugin.types.Capabilities`); the core never branches on a strategy's name.
* **Plugins see only the run.** Per-process state lives on the :class:`~torchrig.host.run.RunContext`
  passed to hooks (``run.stash`` for plugin data), never in module globals.

Plugin objects are registered under ``"<kind>:<name>"`` (runtime objects) and
``"<kind>:<name>#manifest"`` (manifests). Registration order, which fixes call order within a
hook (pluggy calls the most recently registered implementation first, ``tryfirst``/``trylast``
aside): the core defaults; then manifests of every available plugin; then the runtime objects
of the selected plugins, kind by kind — cluster, device, precision, strategy, tracker — and,
within an auto-detected kind (cluster, device), in ascending priority so that the highest
priority answers first.

Hook-API version: :data:`HOOK_API_VERSION`. A plugin's manifest declares the version it was
written for; a mismatch is reported at discovery. Adding a hook or an optional argument does not
change the version (pluggy lets implementations accept a subset of arguments); removing or
changing one does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torchrig.plugin.markers import hookspec

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.checkpoint.files import CheckpointWriter
    from torchrig.config.resolved import ResolvedConfig
    from torchrig.distributed.collectives import Collectives
    from torchrig.distributed.device import DeviceBackend
    from torchrig.estimate.memory import MemoryEstimate, MemoryRequest
    from torchrig.host.run import RunContext
    from torchrig.plugin.tracker import Tracker
    from torchrig.plugin.types import (
        Capabilities,
        CliFlag,
        ClusterInfo,
        ConfigProblem,
        ConfigSection,
        LaunchPlan,
        PreparedModel,
    )
    from torchrig.training.step_plan import StepPlanBuilder

#: Version of this hook contract. Plugins declare the version they were written for.
#: 2: ``Capabilities`` lost ``owns_backward``, ``owns_optimizer_step``, ``owns_clipping`` and
#: ``checkpoint_format`` — no core code read them; filling a step-plan slot or implementing a
#: checkpoint hook is the declaration.
HOOK_API_VERSION = 2

#: Hook-API versions this torchrig can load.
SUPPORTED_HOOK_API_VERSIONS = frozenset({2})


# --------------------------------------------------------------------------------------------
# Configuration — implemented by manifests (torch-free). Called in the launcher and in workers.
# --------------------------------------------------------------------------------------------


@hookspec
def torchrig_config_sections() -> list[ConfigSection]:
    """Declare this plugin's own configuration section(s).

    - phase: configuration, before anything is validated or started.
    - ranks: the launcher and every worker; also ``torchrig config``/``plugins``.
    - kind: collecting, over the manifests of every *available* plugin (selected or not), so
      that a config file may carry e.g. an ``fsdp_config`` section while DDP is selected.
    - return: :class:`~torchrig.plugin.types.ConfigSection` objects (key, attrs options class,
      aliases such as Accelerate's spelling).
    - default: none; a plugin without options returns nothing.

    Must not import torch or the plugin's heavy dependencies.
    """


@hookspec
def torchrig_cli_flags() -> list[CliFlag]:
    """Contribute command-line flags to ``torchrig launch``.

    - phase: configuration (building the launcher's argument parser).
    - ranks: the launcher only.
    - kind: collecting, over the manifests of every available plugin.
    - return: :class:`~torchrig.plugin.types.CliFlag` objects. Each flag maps onto a dotted config key,
      so a flag is just the highest-precedence source of that key, validated like any other.
    - default: none.

    Must not import torch. Two plugins contributing the same flag is an error naming both.
    """


@hookspec
def torchrig_validate_config(config: ResolvedConfig) -> list[ConfigProblem | str]:
    """Report what is wrong with the resolved configuration, from this plugin's point of view.

    - phase: configuration, twice with the same messages: in the launcher before any worker
      starts (file, environment and flags) and in each worker after the script's
      ``Accelerator(...)`` arguments are merged, before any process group is used.
    - ranks: the launcher; every worker.
    - kind: collecting, over the manifests of the *selected* plugins and the core. All
      problems from all plugins are reported together in one :class:`~torchrig.errors.ConfigError`.
    - arguments: ``config`` — the resolved configuration (:class:`~torchrig.config.resolved.ResolvedConfig`:
      ``config.section_of(Options)`` for a typed section, ``config.is_set(key)`` for what a source set).
    - return: problems (:class:`~torchrig.plugin.types.ConfigProblem` or plain strings); an empty
      list or ``None`` when satisfied. Cross-plugin checks belong here (DeepSpeed: "fp16 in
      ``mixed_precision`` but a bf16 block in the DeepSpeed JSON").
    - default: none.
    """


# --------------------------------------------------------------------------------------------
# Environment — which process am I, on which device, connected how.
# --------------------------------------------------------------------------------------------


@hookspec(historic=True)
def torchrig_configure(run: RunContext) -> None:
    """The run context exists: configuration, cluster and device are resolved.

    - phase: end of ``Accelerator`` construction, after the process group is initialised.
    - ranks: every worker.
    - kind: historic — a plugin registered later (e.g. a tracker added at ``init_trackers``)
      receives the call on registration.
    - default: none.
    """


@hookspec
def torchrig_unconfigure(run: RunContext) -> None:
    """The run ends: release what ``configure`` took.

    - phase: teardown — ``Accelerator.end_training()``, or interpreter exit for a run still
      alive then (a run already garbage-collected gets no call). Once per run.
    - ranks: every worker. kind: collecting. default: none.
    """


@hookspec(firstresult=True)
def torchrig_detect_cluster(environ: Mapping[str, str]) -> ClusterInfo | None:
    """Say where this process sits in the job, if this cluster environment is the one in use.

    - phase: environment, first thing in a worker (and in the launcher for multi-node).
    - ranks: every worker.
    - kind: firstresult, over the cluster plugins in descending priority (or only the one named
      by the ``cluster`` option). A plugin answers only when it recognises ``environ``
      (torchelastic: ``TORCHELASTIC_RUN_ID``; slurm: ``SLURM_PROCID``...), else ``None``. The
      built-in ``process_group`` plugin answers from a default process group that exists
      already instead (``torch.distributed`` imported and initialised by someone else).
    - arguments: ``environ`` — the process environment (a copy; tests pass recorded ones).
    - return: :class:`~torchrig.plugin.types.ClusterInfo`.
    - default: a single process, rank 0 of 1.
    """


@hookspec(firstresult=True)
def torchrig_select_device(run: RunContext) -> DeviceBackend | None:
    """Claim this process's device, if this device kind is available and allowed.

    - phase: environment, after cluster detection.
    - ranks: every worker.
    - kind: firstresult, over the device plugins in descending priority (cuda before mps before
      cpu), or only the one forced by config (``use_cpu``/``cpu=True`` selects ``cpu``).
    - return: a :class:`~torchrig.distributed.device.DeviceBackend`: the ``torch.device`` for this local
      rank, its process-group backend (``nccl``/``gloo``), seeding, RNG state, precision support.
    - default: the CPU.
    """


@hookspec(firstresult=True)
def torchrig_init_process_group(run: RunContext) -> bool | None:
    """Initialise the default process group for a multi-process run.

    - phase: environment, after device selection; before any collective.
    - ranks: every worker, collectively.
    - kind: firstresult. A strategy answers when it must initialise communication its own way
      (DeepSpeed: ``deepspeed.init_distributed``); otherwise the core does.
    - return: ``True`` once the group is ready.
    - default: ``torch.distributed.init_process_group`` with the device's backend and the one
      configured collective timeout, when ``world_size > 1`` and no group exists yet; nothing
      for one process. A group that exists already (Ray Train's, the user's, an earlier
      Accelerator's) was checked and adopted by the core just before this call
      (:mod:`torchrig.distributed.process_group`): implementations must not create another.
    """


@hookspec(firstresult=True)
def torchrig_collectives(run: RunContext) -> Collectives | None:
    """Provide the collective operations (gather, reduce, broadcast, barrier).

    - phase: environment; asked once, the returned object is called directly afterwards.
    - ranks: every worker.
    - kind: firstresult. A strategy or device overrides when torch.distributed is not the
      transport (e.g. XLA).
    - return: a :class:`~torchrig.distributed.collectives.Collectives`.
    - default: torch.distributed collectives (identity on one process).
    """


@hookspec(firstresult=True)
def torchrig_requeue_command(environ: Mapping[str, str]) -> list[str] | None:
    """The command that puts the job this process belongs to back in its scheduler's queue.

    - phase: preemption (``preemption.requeue``): asked when the Accelerator is created, to
      refuse a requeue nobody can do, and run by the main process after the preemption
      checkpoint committed (docs/preemption.md).
    - ranks: every worker asks; only the main process runs the command.
    - kind: firstresult, over the cluster plugins. A plugin answers when ``environ`` shows a job
      of its scheduler — whoever started the rank (Slurm: ``SLURM_JOB_ID`` is set also under
      ``srun torchrig launch``, where torchelastic describes the rank) — else ``None``.
    - arguments: ``environ`` — the process environment (a copy).
    - return: the argument list to run (``["scontrol", "requeue", "<job id>"]``); ``[]`` means
      this environment cannot requeue.
    - default: ``[]``.
    """


# --------------------------------------------------------------------------------------------
# Preparation — ``Accelerator.prepare``: wrap models with their optimizers, data, schedulers.
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def torchrig_strategy_capabilities(run: RunContext) -> Capabilities | None:
    """Declare what the core must know beyond the step plan: whether the strategy owns
    accumulation and precision, whether parameters are replicated, the data-parallel layout.

    Phases the strategy performs (backward, optimizer step, zero_grad, clipping, no_sync) are
    declared by filling their slots in ``torchrig_strategy_step_plan``, and its checkpoint format
    by implementing ``torchrig_save_strategy_state``/``torchrig_load_strategy_state`` — never
    twice. DDP: replicated parameters; FSDP2: owns precision (its MixedPrecisionPolicy),
    sharded; DeepSpeed: owns accumulation and precision; an N-D mesh (``parallelism_config``): the
    data-parallel size and rank of its DP sub-mesh (loaders shard by them, not by the world) and
    the mesh itself in ``device_mesh`` (``accelerator.torch_device_mesh``), its named and flattened
    sub-meshes in ``device_submeshes`` (``dp``, ``dp_shard_cp``, ``dp_cp``, each axis; a ``cp`` entry
    is what ``accelerator.maybe_context_parallel`` shards over).

    Accumulation count (``accumulation_steps``): the core owns the run's gradient-accumulation
    state and is its only writer. A strategy whose engine is built with a count of its own
    configuration declares it; at ``prepare``, before any model is prepared, the core adopts it
    when the run left ``gradient_accumulation_steps`` at its default (no source set it, 1), and
    keeps the run's count otherwise. The strategy then reads the result — ``run.stash[ACCUMULATION_STATE]``,
    typed read-only (:class:`~torchrig.plugin.types.AccumulationState`) — to build its engine, and
    reads ``sync_gradients`` from it on each micro-step. DeepSpeed: ``deepspeed_config.gradient_accumulation_steps``
    or a number in its JSON, else None; DDP, FSDP2 and an N-D mesh: None (the core counts, their
    ``no_sync`` slot suppresses the micro-steps' communication).

    - phase: preparation, once before the first model is prepared.
    - ranks: every worker. kind: firstresult (the selected strategy answers).
    - return: :class:`~torchrig.plugin.types.Capabilities`.
    - default: owns nothing; every rank is a data-parallel rank; no accumulation count.
    """


@hookspec
def torchrig_convert_model(run: RunContext, model: Any) -> None:
    """Convert the user's module in place before the strategy wraps it.

    Numerics that change the module itself (fp8: ``nn.Linear`` → torchao's ``Float8Linear``)
    must happen before sharding and compile: ``fully_shard`` then shards the converted weights
    (and all-gathers them in the dtype their tensor subclass chooses), and ``torch.compile``
    traces the converted forward. Parameters a conversion replaces are followed by the core:
    optimizers built before ``prepare`` are remapped by parameter name.

    - phase: preparation, once per model, after ``torchrig_strategy_capabilities`` (so
      ``run.capabilities`` says how the strategy will hold the parameters) and before
      ``torchrig_prepare_model``.
    - ranks: every worker (each converts its own copy identically).
    - kind: collecting, over every registered plugin; the built-in precisions do not implement
      it (autocast needs no conversion).
    - arguments: ``model`` — the user's ``torch.nn.Module``, not yet moved or wrapped.
    - return: ``None``; the module is changed in place.
    - checked against: DDP (wraps the converted module), FSDP2 (``fully_shard`` of the
      converted module; ``Capabilities.fully_shard_parameters``), DeepSpeed (its engine keeps
      its own precision: a plugin that cannot compose with it refuses at configuration).
    - default: none (the module is prepared as given).
    """


@hookspec(firstresult=True)
def torchrig_prepare_model(
    run: RunContext, model: Any, optimizers: Sequence[Any], schedulers: Sequence[Any], device_placement: bool
) -> PreparedModel | None:
    """Wrap one model together with the optimizers (and schedulers) over its parameters.

    Model and optimizers are prepared together because strategies need both at once:
    DeepSpeed's ``initialize`` takes model, optimizer and scheduler and returns an engine;
    FSDP2's ``fully_shard`` replaces parameters with sharded ones, so optimizers built before
    ``prepare`` must have their param groups remapped (Accelerate silently leaves them on the
    old tensors); DDP moves the module and wraps it.

    - phase: preparation, once per model, in the order the user passed them.
    - ranks: every worker, collectively (wrapping may broadcast or shard).
    - kind: firstresult (the selected strategy answers).
    - arguments: ``model`` — the user's ``torch.nn.Module``; ``optimizers`` — the user's
      optimizers whose parameters belong to this model (the core pairs them by parameter
      identity); ``schedulers`` — the user's schedulers whose optimizer is among those;
      ``device_placement`` — False when the user asked not to move the model.
    - return: :class:`~torchrig.plugin.types.PreparedModel`.
    - planning (``run.planning``, ``torchrig plan``): the process group is torch's fake one (one
      process plays one rank of the target world; collectives return at once) and ``model`` is on
      the meta device. Lay it out exactly as the real run would — the same mesh, plans, wrapping,
      pipeline stages, and the same errors — but move, materialise, load or broadcast nothing: the
      plan then gives the parameters fake storage and runs one step under ``FakeTensorMode``,
      recording every collective the wrapped model issues. A strategy whose engine cannot hold a
      meta-device model raises :class:`~torchrig.errors.PlanningUnsupported`: the plan reports the
      rank as not planned, and ``torchrig estimate-memory`` sizes it by its
      ``torchrig_estimate_memory`` answer instead.
    - checked against: FSDP2 and the N-D mesh (``fully_shard``/``parallelize_module``/pipeline
      split on meta parameters, as torchtitan initialises; materialisation skipped when planning),
      DDP (its C++ reducer needs storage: when planning, a stand-in issues the reducer's bucketed
      all-reduces), DeepSpeed (``deepspeed.initialize`` needs storage: ``PlanningUnsupported``).
    - default: move the module to ``run.device`` (unless ``device_placement`` is False);
      optimizers and schedulers unchanged; when planning, nothing moves.
    """


@hookspec(firstresult=True)
def torchrig_prepare_dataloader(run: RunContext, dataloader: Any, device_placement: bool) -> Any:
    """Shard a DataLoader across data-parallel ranks and place its batches on the device.

    - phase: preparation, once per DataLoader.
    - ranks: every worker.
    - kind: firstresult. Strategies rarely answer: data-parallel sharding is the core's job,
      parametrised by the strategy's declared ``data_parallel_size``/``rank``. A device whose
      loading differs (XLA's parallel loader) may.
    - arguments: ``device_placement`` — False when batches must stay where the loader puts them.
    - return: the prepared loader (iterable, ``len()``, ``state_dict()``/``load_state_dict()``).
    - default: the core's data layer (:mod:`torchrig.data`).
    """


@hookspec(firstresult=True)
def torchrig_prepare_scheduler(run: RunContext, scheduler: Any, optimizers: Sequence[Any]) -> Any:
    """Wrap a learning-rate scheduler so it steps once per *optimizer* step.

    - phase: preparation, once per scheduler, after its optimizer is prepared.
    - ranks: every worker. kind: firstresult.
    - arguments: ``optimizers`` — the prepared optimizers the scheduler drives.
    - return: the scheduler to hand back to the user.
    - default: a wrapper whose ``step()`` is a no-op while gradients are accumulating or when
      the optimizer step was skipped (fp16 overflow); never multiplied by the number of
      processes (Accelerate's most reported trap).
    """


@hookspec
def torchrig_precision_step_plan(run: RunContext, plan: StepPlanBuilder) -> None:
    """Install the precision plugin's callables into the step plan.

    - phase: preparation, when the step plan is (re)built; never per step.
    - ranks: every worker.
    - kind: collecting, over the selected precision plugin. Not called when the strategy
      declares ``owns_precision`` (DeepSpeed; FSDP2 whose MixedPrecisionPolicy replaces
      autocast).
    - arguments: ``plan`` — the builder; ``plan.set(slot, fn)`` replaces a slot,
      ``plan.get(slot)`` returns the current callable to wrap. fp16 sets ``autocast`` and wraps
      ``backward`` (scale), ``unscale_gradients``, ``optimizer_step`` (scaler step/update).
    - default: the core fills every slot with plain PyTorch before this hook.
    """


@hookspec
def torchrig_strategy_step_plan(run: RunContext, plan: StepPlanBuilder) -> None:
    """Install the strategy's callables for what it declared it owns.

    - phase: preparation, after the precision plugin's step plan; never per step.
    - ranks: every worker. kind: collecting, over the selected strategy.
    - Examples: DeepSpeed sets ``backward`` (``engine.backward``), ``optimizer_step``
      (``engine.step``), ``zero_grad`` (no-op), ``clip_grad_norm`` (engine-owned, returns the
      global norm); DDP sets ``no_sync`` (``model.no_sync()``); FSDP2 sets ``no_sync``
      (``set_requires_gradient_sync(False)``) and a shard-aware ``clip_grad_norm``.
    - default: none (the core's plain-PyTorch slots stay).
    """


@hookspec
def torchrig_wrap_step_plan(run: RunContext, plan: StepPlanBuilder) -> None:
    """Wrap step-plan callables with cross-cutting behaviour (timing, NaN guards).

    - phase: preparation, last of the step-plan hooks. ranks: every worker.
    - kind: collecting, over every registered plugin. Off the default path: a plugin wraps
      only when the user enabled it, since every wrapper costs time on every step.
    - default: none.
    """


# --------------------------------------------------------------------------------------------
# Checkpoints — strategy-owned state inside the core's commit protocol.
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def torchrig_save_strategy_state(
    run: RunContext, prepared: Sequence[PreparedModel], directory: str, writer: CheckpointWriter
) -> list[str] | None:
    """Write model and optimizer state of every prepared model into ``directory``.

    ``directory`` is the core's temporary checkpoint directory; the core fsyncs, manifests and
    commits it afterwards (DeepSpeed's own ``latest`` and DCP's metadata are not trusted for
    commit). The core saves everything else (schedulers, RNG, data position, counters).
    Write through ``writer`` (``save_tensors``, ``save_torch``: fsynced, sized, hashed while
    streaming, deferred to a background thread for asynchronous saves; ``writer.safe_serialization``
    says whether weights should be safetensors). Files a library writes itself (DCP, an engine) go
    through ``writer.library_write(write)``: ``write()`` runs now, or — when ``writer.deferred`` (an
    asynchronous save) — in the background half, so stage what it writes on the CPU first and run its
    collectives on ``writer.background_group``. Files returned instead are fsynced, sized and hashed
    too, but are written before ``save_state`` returns.

    - phase: ``save_state``. ranks: every worker, collectively.
    - kind: firstresult (the selected strategy). Plain state dicts are written by the main
      process; sharded formats (FSDP2/DCP) and engines (DeepSpeed) write on every rank.
    - return: paths, relative to ``directory``, of the files *this rank* wrote.
    - default: the main process writes each model's and optimizer's ``state_dict``.
    """


@hookspec(firstresult=True)
def torchrig_load_strategy_state(
    run: RunContext, prepared: Sequence[PreparedModel], directory: str, manifest: Mapping[str, Any],
    allow_pickle: bool,
) -> bool | None:
    """Load what :func:`torchrig_save_strategy_state` wrote into the prepared objects.

    ``manifest`` is the checkpoint's verified manifest (``world_size`` at save, ``strategy``,
    ``layout`` — the mesh it was saved under, :mod:`torchrig.checkpoint.topology` — and
    ``files``): a strategy that cannot load at another world size or layout says so here, naming
    both layouts and the conversion to use. Unless ``allow_pickle``, nothing may be unpickled beyond what
    ``torch.load(weights_only=True)`` accepts: a file that needs more is refused with an error
    naming it and ``load_state(..., allow_pickle=True)`` (the checkpoint may be untrusted).

    - phase: ``load_state``, after the core verified the checkpoint's manifest.
    - ranks: every worker, collectively. kind: firstresult.
    - return: ``True`` when loaded.
    - default: every rank loads the plain state dicts (mapped to its device).
    """


@hookspec(firstresult=True)
def torchrig_full_state_dict(run: RunContext, prepared: PreparedModel) -> dict[str, Any] | None:
    """Return the model's full (unsharded) state dict, for ``save_model``/``get_state_dict``.

    - phase: export. ranks: every worker, collectively (FSDP2 and ZeRO-3 gather shards).
    - kind: firstresult.
    - return: the full state dict on the main process (CPU tensors allowed); other ranks may
      return an empty dict.
    - default: the unwrapped module's ``state_dict()``.
    """


@hookspec
def torchrig_checkpoint_state(run: RunContext) -> Mapping[str, Any] | None:
    """Objects this plugin owns whose state belongs in every checkpoint (GradScaler, EMA...).

    - phase: ``save_state`` and ``load_state``. ranks: every worker.
    - kind: collecting. Each object has ``state_dict()``/``load_state_dict()``; the main process
      writes ``<name>.pt`` and every rank loads it, so objects must be identical across ranks.
    - return: ``{name: object}``; names are file names and must be unique across plugins.
    - default: none.
    """


@hookspec
def torchrig_checkpoint_committed(run: RunContext, directory: str, manifest: Mapping[str, Any]) -> None:
    """A checkpoint was committed (renamed into place, ``latest`` updated).

    - phase: after ``save_state``. ranks: the main process. kind: collecting.
    - Use for uploads or notifications; wrap with ``wrapper=True`` for work around the commit.
    - default: none.
    """


# --------------------------------------------------------------------------------------------
# Tracking — experiment trackers.
# --------------------------------------------------------------------------------------------


@hookspec
def torchrig_create_trackers(
    run: RunContext, project_name: str, logging_dir: str | None, init_kwargs: Mapping[str, Mapping[str, Any]]
) -> list[Tracker]:
    """Create this tracker plugin's tracker(s) for the run.

    - phase: ``init_trackers``.
    - ranks: the main process only, by core policy (not repeated in each tracker): a job makes
      one run per tracker, not one per rank.
    - kind: collecting, over the selected tracker plugins.
    - arguments: ``project_name`` — ``init_trackers``' first argument (W&B project, MLflow
      experiment, directory under ``logging_dir``); ``logging_dir`` — the project's logging
      directory (``project_config.logging_dir`` under ``project_dir``), None when neither is
      set; ``init_kwargs`` — ``init_trackers(init_kwargs=...)``, keyed by tracker name: a plugin
      passes its own entry to its library.
    - return: :class:`~torchrig.tracking.hub.Tracker` objects, created cheaply (no I/O: connecting
      belongs in ``Tracker.start``). The core calls them from a bounded background queue so a
      failing or blocking tracker never stops or slows training; a ``TypeError``/``ValueError``
      raised here (bad ``init_kwargs``) fails ``init_trackers`` naming the plugin.
    - default: none.
    """


# --------------------------------------------------------------------------------------------
# Planning — ``torchrig estimate-memory`` (no process group, no device, nothing allocated).
# --------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def torchrig_estimate_memory(request: MemoryRequest) -> MemoryEstimate | None:
    """Say what one rank holds when this strategy trains ``request.model`` — for a strategy the plan
    cannot run (its ``prepare`` raises ``PlanningUnsupported``); every other one is sized by a
    planned step, the project's one model of memory.

    - phase: planning, in ``torchrig estimate-memory`` (and anyone sizing a job); never in a
      training run.
    - ranks: the command's one process; no process group exists.
    - kind: firstresult, asked of the *manifest* of the selected strategy, then of the core
      default — the core calls only those two, whatever other strategies are installed. Torch-free
      arithmetic on :mod:`torchrig.estimate.memory` objects: implement it on the manifest, so estimating
      never imports the strategy's library (DeepSpeed).
    - arguments: ``request`` — a :class:`~torchrig.estimate.memory.MemoryRequest`: the model's
      :class:`~torchrig.estimate.memory.ModelFootprint` (every parameter's element count, first dimension,
      dtype and trainability; the largest repeated block; activation bytes saved for backward at
      the requested batch, or why they are unknown), the data-parallel ``world_size``, the
      precision plugin's name, the optimizer's state bytes per element and per tensor, and the
      resolved ``config`` (the strategy reads its own section: ZeRO stage, offload devices,
      ``reshard_after_forward``, a future mesh's ``dp_shard``/``tp`` sizes).
    - return: a :class:`~torchrig.estimate.memory.MemoryEstimate` — per-rank
      :class:`~torchrig.estimate.memory.MemoryComponent` lines, each on ``"device"`` or ``"cpu"``, that the
      core *sums*; lines for everything held at the peak of a step, at once: parameters,
      gradients, optimizer state, master weights when the strategy keeps a separate fp32 copy,
      activations, and transient buffers (all-gathered units, communication buckets). Notes say
      what was not modelled.
    - checked against: DDP, FSDP2 and the N-D mesh need no answer — a strategy the plan can run
      is sized by one planned step (:mod:`torchrig.estimate.planned_memory`), so only a strategy
      whose ``prepare`` raises ``PlanningUnsupported`` answers; DeepSpeed ZeRO 0–3 (stage 1 shards the
      optimizer state and the fp32 master copy, 2 also gradients, 3 also parameters; offload moves
      optimizer state and master weights, or parameters, to ``"cpu"``); an N-D mesh divides each
      line by the mesh axes that shard it (``tp`` parameters and activations, ``dp_shard`` what
      FSDP shards) — the request carries the configuration, the estimate the per-rank result.
    - default: everything whole on every rank (one process; replicated data parallelism), with
      fp32 parameters as their own master weights.
    """


# --------------------------------------------------------------------------------------------
# Launch — ``torchrig launch`` (the launcher process).
# --------------------------------------------------------------------------------------------


@hookspec
def torchrig_worker_environment(plan: LaunchPlan) -> dict[str, str] | None:
    """Environment variables every worker of this launch needs.

    - phase: launch, before workers start. ranks: the launcher.
    - kind: collecting, over selected plugins; later plugins override earlier keys, and the
      user's own environment overrides all.
    - Examples: DeepSpeed ``DS_ACCELERATOR=cpu`` on a machine without GPUs; the core's
      ``OMP_NUM_THREADS`` for several workers on few cores.
    - default: none.
    """


@hookspec(firstresult=True)
def torchrig_launch(plan: LaunchPlan) -> int | None:
    """Start the workers of this node and wait for them.

    - phase: launch. ranks: the launcher. kind: firstresult; wrappers may surround it.
    - return: the launcher's exit code.
    - default: ``torch.distributed.elastic`` (the engine torchrun uses).
    - A cluster plugin answers where its scheduler should start the ranks instead (the slurm
      plugin: ``srun`` inside an allocation, ``sbatch`` with ``cluster: slurm`` outside one; the
      mpi plugin: ``mpirun``), running ``plan.script_command`` once per rank, and returns
      ``None`` elsewhere.
    """


@hookspec
def torchrig_describe_launch(plan: LaunchPlan) -> str | None:
    """What this plugin's ``torchrig_launch`` would start for ``plan``, for ``--dry-run``.

    - phase: launch, ``torchrig launch --dry-run`` only (nothing is started). ranks: the launcher.
    - kind: collecting; a plugin answers exactly where its ``torchrig_launch`` would take the
      launch (e.g. the ``sbatch`` script it would submit, the ``mpirun`` line), else ``None``.
    - return: text printed under "Hand-off" in the dry run.
    - default: none (torch elastic; the dry run prints each rank's environment).
    """
