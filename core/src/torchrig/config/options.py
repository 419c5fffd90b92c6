"""The core's configuration options, with Accelerate's class names and parameters.

``CoreOptions`` holds the top-level keys of a config file (Accelerate's ``default_config.yaml``
keys among them); the other classes are sections (``dataloader_config:``, ``project_config:``...)
and the objects users pass to ``Accelerator(...)``. Plugin-owned classes
(``FullyShardedDataParallelPlugin``, ``DeepSpeedPlugin``, ``DistributedDataParallelKwargs``)
live in their plugins. Torch-free.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

import attrs

from torchrig.config.schema import at_least, between, option
from torchrig.plugin.tracker import Tracker  # Accelerator(log_with=[MyTracker()]) passes instances
from torchrig.plugin.types import ConfigSection


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _seconds(value: Any) -> Any:
    """Accept a ``datetime.timedelta`` where seconds are expected (Accelerate passes one)."""
    return value.total_seconds() if isinstance(value, datetime.timedelta) else value


def _gpu_ids(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


class KwargsHandler:
    """Base of the options objects passed in ``Accelerator(kwargs_handlers=[...])`` (Accelerate's
    ``KwargsHandler``): ``to_dict()`` gives every field, ``to_kwargs()`` the fields that differ
    from the class's defaults (``PartialState(**InitProcessGroupKwargs(timeout=60).to_kwargs())``)."""

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self, recurse=False)  # type: ignore[arg-type]

    def to_kwargs(self) -> dict[str, Any]:
        defaults = type(self)().to_dict()
        return {key: value for key, value in self.to_dict().items() if defaults[key] != value}


@attrs.frozen(kw_only=True)
class CoreOptions:
    """Top-level configuration keys."""

    strategy: str | None = option(
        None,
        help="strategy plugin: single, ddp, fsdp, deepspeed, or a third-party one; default: single for one "
        "process, the installed default data-parallel strategy for several",
        aliases=("distributed_type",),
        choices_from_kind="strategy",
    )
    mixed_precision: str = option(
        "no", help="precision plugin: no, fp16, bf16, fp8 (torchrig[fp8]; docs/precision.md) or a third-party one", choices_from_kind="precision",
        normalize=_lower,
    )
    use_cpu: bool = option(False, help="run on the CPU even when an accelerator is available", aliases=("cpu",))
    device: str | None = option(None, help="force a device plugin (cuda, mps, cpu or third-party) instead of auto-detection",
                                choices_from_kind="device")
    cluster: str | None = option(None, help="force a cluster-environment plugin instead of auto-detection",
                                 choices_from_kind="cluster")
    num_processes: int | None = option(None, help="total number of processes (all machines)", validator=at_least(1))
    num_machines: int = option(1, help="number of machines (with --num_machines MIN:MAX: the most)", validator=at_least(1))
    min_machines: int | None = option(None, help="elastic world size: the fewest machines the run goes on with "
                                      "(--num_machines MIN:MAX sets it; None: exactly num_machines)",
                                      validator=at_least(1))
    machine_rank: int = option(0, help="rank of this machine, 0..num_machines-1", validator=at_least(0))
    main_process_ip: str | None = option(None, help="address of the machine with rank 0")
    main_process_port: int | None = option(None, help="port of the rendezvous on the main machine (0: a free port)",
                                           validator=between(0, 65535))
    rdzv_backend: str | None = option(None, help="rendezvous backend", choices=("static", "c10d", "etcd", "etcd-v2"),
                                      normalize=_lower)
    rdzv_endpoint: str | None = option(None, help="rendezvous endpoint HOST:PORT (default: main_process_ip:main_process_port)")
    gpu_ids: str | None = option(None, help="GPUs to use: 'all' or a comma-separated list of indices", normalize=_gpu_ids)
    gradient_accumulation_steps: int = option(1, help="micro-steps per optimizer step", validator=at_least(1))
    log_with: list[str | Tracker] = option(factory=list, help="tracker plugins to log to ('all': every installed one)",
                                           choices_from_kind="tracker")
    tracker_hyperparameters: str = option(
        "summary", help="what init_trackers records as hyperparameters besides its config=: 'summary' (strategy, "
        "precision, accumulation and every value a file, variable, flag or argument set, with its source) or "
        "'full' (every resolved key; docs/trackers.md)", choices=("summary", "full"), normalize=_lower)
    disable_plugins: list[str] = option(factory=list, help="plugins to disable: 'kind:name' or a bare name")
    strict_config: bool = option(False, help="make overriding an explicit Accelerator(...) argument an error, not a warning")


@attrs.frozen(kw_only=True)
class DataLoaderConfiguration:
    """How prepared DataLoaders split and place data (Accelerate's class and parameters)."""

    split_batches: bool = option(False, help="split each batch across processes instead of giving each process its own")
    dispatch_batches: bool | None = option(None, help="main process iterates and sends each process its share")
    even_batches: bool = option(True, help="pad the last batches so every process gets the same number")
    use_seedable_sampler: bool = option(False, help="accepted for compatibility: torchrig's prepared loaders always "
                                        "shuffle with their own seeded generator")
    use_configured_sampler: bool = option(False, help="keep the DataLoader's own sampler and shard its batches")
    data_seed: int | None = option(None, help="seed of the seedable sampler's generator")
    non_blocking: bool = option(False, help="copy batches to the device with non_blocking=True")
    use_stateful_dataloader: bool = option(False, help="accepted for compatibility: torchrig's prepared loaders are "
                                           "always resumable mid-epoch (state_dict/load_state_dict)")
    gradient_accumulation_kwargs: dict[str, Any] | None = option(
        None, help="GradientAccumulationPlugin parameters to apply with this dataloader configuration"
    )


@attrs.frozen(kw_only=True)
class ProjectConfiguration:
    """Where outputs go and how checkpoints are named and rotated."""

    project_dir: str | None = option(None, help="root directory for outputs", aliases=("project_directory",))
    logging_dir: str | None = option(None, help="directory for tracker logs (relative to project_dir)")
    automatic_checkpoint_naming: bool = option(False, help="save to project_dir/checkpoints/checkpoint_<iteration>")
    total_limit: int | None = option(None, help="keep at most this many checkpoints", validator=at_least(1))
    iteration: int = option(0, help="number of the next automatic checkpoint", validator=at_least(0))
    iteration_checkpoints: bool = option(False, help="accepted for compatibility with older Accelerate configurations")
    save_on_each_node: bool = option(False, help="save()/save_model() write on every node, not only the main one "
                                     "(for disks the nodes do not share)")
    async_save: bool = option(False, help="torchrig: save_state writes in the background; training waits only for "
                              "the copy to CPU memory")
    checkpoint_hashes: bool = option(False, help="torchrig: sha256 of every checkpoint file in the manifest, "
                                     "computed while writing")
    allow_world_size_change: bool = option(False, help="torchrig: load_state() converts a checkpoint saved by "
                                           "another number of processes (as Accelerate does) instead of refusing "
                                           "it; an explicit load_state(allow_world_size_change=...) wins")
    allow_config_change: bool = option(False, help="torchrig: load_state() loads a checkpoint saved under another "
                                       "configuration (precision, accumulation...) instead of refusing it, as "
                                       "Accelerate does; an explicit load_state(allow_config_change=...) wins")


@attrs.frozen(kw_only=True)
class GradientAccumulationPlugin:
    num_steps: int | None = option(None, help="micro-steps per optimizer step", validator=at_least(1))
    adjust_scheduler: bool = option(True, help="step schedulers once per optimizer step")
    sync_with_dataloader: bool = option(True, help="force a gradient sync at the end of the dataloader")
    sync_each_batch: bool = option(False, help="sync gradients on every micro-step (saves memory with FSDP)")


@attrs.frozen(kw_only=True)
class AutocastKwargs(KwargsHandler):
    enabled: bool = option(True, help="enable autocast")
    cache_enabled: bool | None = option(None, help="autocast weight cache")


#: The configuration section of :class:`GradScalerKwargs`.
GRAD_SCALER_SECTION = "grad_scaler_kwargs"


@attrs.frozen(kw_only=True)
class GradScalerKwargs(KwargsHandler):
    init_scale: float = option(65536.0, help="initial loss scale", validator=at_least(0))
    growth_factor: float = option(2.0, help="scale multiplier after growth_interval steps without overflow")
    backoff_factor: float = option(0.5, help="scale multiplier after an overflow")
    growth_interval: int = option(2000, help="steps without overflow before growing the scale", validator=at_least(1))
    enabled: bool = option(True, help="enable loss scaling")


@attrs.frozen(kw_only=True)
class InitProcessGroupKwargs(KwargsHandler):
    init_method: str | None = option(None, help="torch.distributed init_method (default: env://)")
    timeout: float = option(1800.0, help="collective timeout in seconds, applied to every process group",
                            converter=_seconds, validator=at_least(1))
    backend: str | None = option(None, help="process-group backend (default: the device's: nccl or gloo)")


#: Signals that can ask for a preemption checkpoint: Slurm's ``--signal=USR1@<seconds>`` warning
#: and the SIGTERM a scheduler sends before it kills a job. (SIGUSR2 is the launcher's own
#: parent-death signal; SIGINT stays Ctrl-C.)
PREEMPTION_SIGNALS = ("SIGUSR1", "SIGTERM")


def _signal_names(value: Any) -> Any:
    """``"usr1"``, ``"SIGUSR1"``, ``["USR1", "TERM"]`` and ``"SIGUSR1,SIGTERM"`` all mean signal names."""
    if isinstance(value, str):
        value = [part for part in value.replace(",", " ").split() if part]
    if isinstance(value, (list, tuple)):
        names = []
        for item in value:
            name = str(item).strip().upper()
            names.append(name if name.startswith("SIG") else f"SIG{name}")
        return names
    return value


def _preemption_signals(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    unknown = [name for name in value if name not in PREEMPTION_SIGNALS]
    if unknown:
        raise ValueError(f"expected signal names among {', '.join(PREEMPTION_SIGNALS)}; got {', '.join(unknown)}",
                         attribute)


@attrs.frozen(kw_only=True)
class PreemptionConfig(KwargsHandler):
    """torchrig: a signal asks every rank for a final checkpoint at the next step boundary, then the job
    stops so its scheduler can requeue it (docs/preemption.md)."""

    signals: list[str] = option(factory=list, help="signals that request a preemption checkpoint: SIGUSR1, SIGTERM "
                                "(empty: off). Slurm: #SBATCH --signal=USR1@120", normalize=_signal_names,
                                converter=_signal_names,
                                validator=_preemption_signals)
    requeue: bool = option(False, help="after the checkpoint, put the job back in its scheduler's queue (Slurm: "
                           "scontrol requeue); needs a cluster plugin that can")
    exit_code: int = option(75, help="exit code of a rank that stopped for preemption (75, EX_TEMPFAIL: try again)",
                            validator=between(0, 255))


def _guard_action(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value not in ("skip", "stop", "rollback"):
        raise ValueError(f"expected 'skip', 'stop' or 'rollback'; got {value!r}", attribute)


@attrs.frozen(kw_only=True)
class TrainingGuardConfig(KwargsHandler):
    """torchrig: at each optimizer step every rank agrees whether the loss or gradient norm is non-finite
    or the loss spiked, then skips that step or stops the run naming it (docs/resilience.md)."""

    enabled: bool = option(False, help="check every optimizer step's loss and gradient norm (one small "
                           "all-reduce per optimizer step across every rank)")
    on_nonfinite: str = option("skip", help="a NaN/inf loss or gradient norm on any rank: 'skip' the optimizer "
                               "step on every rank (gradients zeroed, scheduler not advanced), 'stop', or "
                               "'rollback': restart from the last checkpoint and skip the step's batches",
                               validator=_guard_action)
    on_spike: str = option("skip", help="a loss above spike_threshold or spike_zscore: 'skip', 'stop' or "
                           "'rollback'", validator=_guard_action)
    spike_zscore: float | None = option(None, help="a spike: the step's loss more than this many standard "
                                        "deviations above the mean of the last spike_window applied steps "
                                        "(None: no z-score check)")
    spike_window: int = option(50, help="applied steps the z-score's mean and deviation are taken over (the check "
                               "starts once the window is full)", validator=at_least(2))
    spike_threshold: float | None = option(None, help="a spike: the step's loss (mean over ranks) above this "
                                           "value (None: no absolute check)")
    max_skips: int = option(10, help="skipped steps allowed in the run; the next bad step stops it with an error "
                            "naming the step and its batches", validator=at_least(0))
    max_rollbacks: int = option(3, help="rollbacks allowed for the checkpoints directory (counted in its skip "
                                "ledger); the next bad step stops the run naming the step and its batches",
                                validator=at_least(0))
    rollback_exit_code: int = option(76, help="exit code of the ranks that stop for a rollback; torchrig launch "
                                     "restarts them (not counted against --max_restarts)", validator=between(1, 255))


@attrs.frozen(kw_only=True)
class LaunchOptions:
    """torchrig: what ``torchrig launch`` keeps of its runs (docs/launch.md)."""

    log_retention: int = option(20, help="run folders kept in ./torchrig_logs (the default --log_dir): when a launch "
                                "ends, older ones beyond the newest N are deleted; 0: a run that succeeded keeps none "
                                "(a failed run's folder stays until the next launch). A --log_dir is never pruned",
                                validator=at_least(0))


@attrs.frozen(kw_only=True)
class ThroughputMonitorConfig(KwargsHandler):
    """torchrig: samples/s, tokens/s, step time, MFU and peak memory, measured over windows of optimizer
    steps on the main process and logged to the trackers (docs/trackers.md, "Throughput and MFU")."""

    enabled: bool = option(False, help="measure throughput and log it every log_every_n_steps optimizer steps "
                           "(off: nothing is added to the step)")
    log_every_n_steps: int = option(50, help="optimizer steps between two logged measurements (each costs "
                                    "~60 us on a CPU: memory, rates, the tracker call)",
                                    validator=at_least(1))
    window_size: int = option(1, help="logging intervals the rates average over (1: the last log_every_n_steps "
                              "steps)", validator=at_least(1))
    tokens_per_sample: int | None = option(None, help="tokens in one sample (the sequence length); None: no "
                                           "tokens/s unless accelerator.throughput.update(tokens=...) says",
                                           validator=at_least(1))
    flops_per_token: float | None = option(None, help="training FLOPs (forward + backward) per token; None: "
                                           "estimated for a transformer as 6*N + 12*layers*d_model*seq",
                                           validator=at_least(0))
    flops_per_sample: float | None = option(None, help="training FLOPs per sample, for models without tokens "
                                            "(overrides flops_per_token)", validator=at_least(0))
    peak_flops_per_device: float | None = option(None, help="peak FLOP/s of one device for MFU; None: the "
                                                 "table entry of the GPU's name and the precision (CPU: no MFU)",
                                                 validator=at_least(0))
    sync_at_log: bool = option(False, help="synchronize the device before each measurement (exact to the step; "
                               "without it the queued steps make the window rate exact anyway after the first)")


#: ``ProfileKwargs.activities`` names, as Accelerate spells them (``torch.profiler.ProfilerActivity`` members).
PROFILER_ACTIVITIES = ("cpu", "cuda", "xpu", "hpu", "mtia")


def _profiler_activities(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    unknown = [item for item in value if str(item).lower() not in PROFILER_ACTIVITIES]
    if isinstance(value, str) or unknown:
        raise ValueError(f"expected a list of {', '.join(PROFILER_ACTIVITIES)}; got {value!r}", attribute)


@attrs.frozen(kw_only=True)
class ProfileKwargs(KwargsHandler):
    """``torch.profiler.profile`` options for ``accelerator.profile()`` (Accelerate's ``ProfileKwargs``);
    the trace goes to ``output_trace_dir/profile_{process_index}.json``."""

    activities: list[str] | None = option(None, help="profiled activities: cpu, cuda, xpu, hpu, mtia (default: "
                                          "torch's, every available one)", validator=_profiler_activities)
    schedule_option: dict[str, int] | None = option(
        None, help="torch.profiler.schedule arguments (wait, warmup, active, repeat, skip_first); call prof.step()")
    on_trace_ready: Any = option(None, help="callable given the profiler when a trace is ready (Python only)",
                                 python_only=True)
    record_shapes: bool = option(False, help="record operator input shapes")
    profile_memory: bool = option(False, help="track tensor memory allocation")
    with_stack: bool = option(False, help="record source information (file and line) of the operators")
    with_flops: bool = option(False, help="estimate FLOPs of matrix multiplications and convolutions")
    with_modules: bool = option(False, help="record the module hierarchy of the operators")
    output_trace_dir: str | None = option(None, help="directory of the Chrome trace, profile_<process_index>.json")


def _dynamo_backend(value: Any) -> Any:
    if isinstance(value, str):
        value = value.lower()
        return "no" if value in ("no", "none") else value
    return value


@attrs.frozen(kw_only=True)
class TorchDynamoPlugin:
    """``torch.compile`` applied after the strategy wrapped the model."""

    backend: str = option("inductor", help="torch.compile backend ('no' disables compilation)",
                          aliases=("dynamo_backend",), normalize=_dynamo_backend, flag="--dynamo_backend")
    mode: str | None = option(None, help="compile mode: default, reduce-overhead, max-autotune", aliases=("dynamo_mode",), flag="--dynamo_mode")
    fullgraph: bool = option(False, help="require a single graph", aliases=("dynamo_use_fullgraph",), flag="--dynamo_use_fullgraph")
    dynamic: bool | None = option(None, help="dynamic shapes", aliases=("dynamo_use_dynamic",), flag="--dynamo_use_dynamic")
    options: dict[str, Any] | None = option(None, help="backend options")
    disable: bool = option(False, help="disable compilation")
    use_regional_compilation: bool = option(False, help="compile each repeated block instead of the whole model",
                                            aliases=("dynamo_use_regional_compilation",),
                                            flag="--dynamo_use_regional_compilation")
    check_after_steps: int = option(2, help="torchrig: optimizer steps during which each compiled module's calls are "
                                    "watched before it is said whether compiled code ran (docs/compile.md)",
                                    validator=at_least(1))
    recompile_warn_threshold: int = option(4, help="torchrig: recompilations after the check above which one "
                                           "warning is given", validator=at_least(0))


#: Every axis a ``parallelism_config`` may set, outermost first, as Accelerate and torchtitan name them.
PARALLELISM_AXES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
#: Axes borrowed from another axis's ranks, not a factor of the world size: ``ep`` splits ``dp_shard``
#: (expert parallelism, as torchtitan); a strategy that builds it declares it in ``parallelism_axes`` too.
BORROWED_AXES = {"ep": "dp_shard"}
#: Data-parallel axes that may absorb an elastic world-size change (``parallelism_config.elastic_axis``):
#: only they change the batches, not the model's split (tp, cp, pp, ep stay).
ELASTIC_AXES = ("dp_shard", "dp_replicate")
#: torchrig's own tensor-parallel style names (torch.distributed.tensor.parallel's classes), for a
#: strategy that builds a tp axis to declare (``PluginManifest.tp_styles``, with any names it translates).
#: Which names a ``tp_plan`` may use is the selected strategy's declaration, checked in
#: :mod:`torchrig.config.parallelism`; docs/parallelism.md says what each does.
TP_STYLES = ("colwise", "rowwise", "embedding", "output", "sequence_parallel", "prepare_input_sp", "rowwise_sp",
             "embedding_sp", "output_sp")
#: Pipeline schedules ``pp_schedule`` may name (torch.distributed.pipelining's classes, torchtitan's names).
PP_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")


def _mesh_size(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
        raise ValueError(f"must be a positive integer or -1 (inferred from the world size), got {value!r}", attribute)


def _tp_plan(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of module-name patterns to styles, got {value!r}", attribute)
    bad = {k: v for k, v in value.items() if not isinstance(k, str) or not (v is None or isinstance(v, str))}
    if bad:  # the names themselves are the selected strategy's to accept (parallelism_problems)
        pattern, style = next(iter(bad.items()))
        raise ValueError(f"{pattern!r}: {style!r}: expected a module-name pattern mapped to a style name (or null: "
                         "leave the module whole)", attribute)


def _split_points(value: Any) -> Any:
    """``"layers.2,layers.4"`` (a flag, an environment variable) -> a list of names."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, tuple):
        return list(value)
    return value


def _check_split_points(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, list) or not value or not all(isinstance(name, str) and name for name in value):
        raise ValueError(f"expected a non-empty list of module names (e.g. [layers.2]), got {value!r}", attribute)
    if len(set(value)) != len(value):
        raise ValueError(f"names a module twice: {value!r}", attribute)


def default_elastic_axis(chosen: str | None, dp_replicate_size: int) -> str:
    """``elastic_axis`` when given, else ``dp_replicate`` when its size is -1 (the user asked it to
    fill the world), else ``dp_shard``."""
    return chosen or ("dp_replicate" if dp_replicate_size == -1 else "dp_shard")


def _size_option(axis: str, what: str) -> Any:
    # Accelerate's config files spell the keys parallelism_config_<axis>_size.
    return option(1, help=f"{what} (-1: inferred from the world size)", validator=_mesh_size,
                  flag=f"--{axis}_size", aliases=(f"parallelism_config_{axis}_size",))


@attrs.frozen(kw_only=True)
class ParallelismConfig:
    """The device mesh of the run (Accelerate's ``ParallelismConfig``, plus ``pp_size``): how many
    ranks each axis spans; their product is the world size. The strategy that builds the mesh
    declares which axes it supports (``PluginManifest.parallelism_axes``); docs/parallelism.md."""

    dp_replicate_size: int = _size_option("dp_replicate", "data-parallel replicas (HSDP: replicas of the shards)")
    dp_shard_size: int = _size_option("dp_shard", "ranks each replica's parameters are sharded over (FSDP2)")
    tp_size: int = _size_option("tp", "tensor-parallel degree")
    cp_size: int = _size_option("cp", "context-parallel degree (GPU only)")
    pp_size: int = _size_option("pp", "pipeline stages")
    ep_size: int = option(1, help="expert-parallel degree: each mixture-of-experts layer's experts split over ep ranks "
                          "borrowed from dp_shard (must divide dp_shard_size), tokens sent to their experts' ranks",
                          validator=at_least(1), flag="--ep_size", aliases=("parallelism_config_ep_size",))
    tp_plan: dict[str, str | None] | None = option(
        None, help="tensor-parallel plan: module-name glob -> a style the strategy declares (fsdp: colwise, rowwise, "
        "embedding, output, with sequence parallel sequence_parallel, prepare_input_sp, rowwise_sp, embedding_sp, "
        "output_sp, and transformers' names such as colwise_gather_output, embedding_rowwise) (null: leave whole); "
        "default: the model's own base_model_tp_plan", validator=_tp_plan)
    loss_parallel: bool = option(False, help="keep the output projection sharded over tp and compute the "
                                 "cross-entropy on the shards (torch's loss_parallel)")
    pp_split_points: list[str] | None = option(
        None, help="pipeline stage boundaries: the module each stage after the first begins with (e.g. layers.2); "
        "pp_size stages, each the model with the other stages' modules removed (names kept)",
        normalize=_split_points, converter=_split_points, validator=_check_split_points, flag="--pp_split_points")
    pp_split_fn: Any = option(None, help="pp_split_fn(model, stage_index, num_stages) -> the stage's module, instead "
                              "of pp_split_points (Python only)", python_only=True)
    pp_schedule: str = option("1F1B", help="pipeline schedule: GPipe, 1F1B, or Interleaved1F1B (several stages per rank: "
                              "pp_split_points makes a multiple of pp_size stages) (torch.distributed.pipelining)",
                              choices=PP_SCHEDULES, validator=attrs.validators.in_(PP_SCHEDULES), flag="--pp_schedule")
    pp_microbatches: int | None = option(
        None, help="micro-batches each batch is split into by the pipeline schedule (the batch size must be a "
        "multiple); default: pp_size. gradient_accumulation_steps still counts batches per optimizer step",
        validator=attrs.validators.optional(at_least(1)), flag="--pp_microbatches")
    pp_loss_fn: Any = option(None, help="pp_loss_fn(output, target) -> loss of one micro-batch, computed on the last "
                             "stage; default: cross-entropy over the last dimension summed over valid tokens (label != -100), "
                             "divided by the batch's valid tokens (Python only)", python_only=True)
    cp_comm_strategy: str = option("allgather", help="how ring attention exchanges key/value chunks over cp: "
                                   "allgather or alltoall (Accelerate's TorchContextParallelConfig.cp_comm_strategy)",
                                   normalize=_lower, choices=("allgather", "alltoall"))
    cp_load_balance: bool = option(True, help="reorder the sequence head-tail over the cp ranks so causal attention "
                                   "costs each rank the same (needs is_causal attention and a length divisible by "
                                   "2 x cp_size)")
    async_tp: bool = option(False, help="asynchronous tensor parallel: overlap tp communication with the matmuls "
                            "(torch's micro-pipeline TP; CUDA and torch.compile only)")
    elastic_axis: str | None = option(
        None, help="elastic world size (min_machines below num_machines): the data-parallel axis each rendezvous "
        "round re-derives from its world size (world / the other axes' product), the others (tp, cp, pp, ep) kept: "
        "dp_shard or dp_replicate; default: dp_replicate when its size is -1, else dp_shard (docs/resilience.md)",
        choices=ELASTIC_AXES, normalize=_lower, flag="--elastic_axis")

    @property
    def sizes(self) -> dict[str, int]:
        """Each axis's size as configured (-1 not yet inferred)."""
        return {axis: getattr(self, f"{axis}_size") for axis in PARALLELISM_AXES}

    @property
    def enabled(self) -> bool:
        """Whether any size differs from 1, ``ep_size`` included (all 1: the strategy's own layout applies)."""
        return any(size != 1 for size in self.sizes.values()) or self.ep_size != 1

    @property
    def total_size(self) -> int:
        """Product of the sizes (Accelerate's name); -1 axes count as 1."""
        return math.prod(size for size in self.sizes.values() if size > 0)

    def elastic_axis_for(self, core: CoreOptions) -> str | None:
        """The axis each rendezvous round re-derives from its world size when ``core`` describes an
        elastic world (``min_machines`` below ``num_machines``): ``elastic_axis``, by default
        ``dp_replicate`` when its size is -1, else ``dp_shard``; None when the world is fixed."""
        if core.min_machines is None or core.min_machines >= core.num_machines:
            return None
        return default_elastic_axis(self.elastic_axis, self.dp_replicate_size)


@attrs.frozen(kw_only=True)
class TorchTensorParallelPlugin:
    """Accelerate's older way to ask for tensor parallelism: ``Accelerator(torch_tp_plugin=
    TorchTensorParallelPlugin(tp_size=N))`` sets ``parallelism_config.tp_size``."""

    tp_size: int = option(1, help="tensor-parallel degree", validator=_mesh_size)


#: The core's own sections, declared through ``torchrig_config_sections`` like any plugin's.
CORE_SECTIONS: tuple[ConfigSection, ...] = (
    ConfigSection("dataloader_config", DataLoaderConfiguration, help="DataLoaderConfiguration"),
    ConfigSection("project_config", ProjectConfiguration, help="ProjectConfiguration"),
    ConfigSection("gradient_accumulation_plugin", GradientAccumulationPlugin, help="GradientAccumulationPlugin"),
    ConfigSection("autocast_kwargs", AutocastKwargs, help="AutocastKwargs"),
    ConfigSection(GRAD_SCALER_SECTION, GradScalerKwargs, help="GradScalerKwargs"),
    ConfigSection("init_process_group_kwargs", InitProcessGroupKwargs, help="InitProcessGroupKwargs"),
    ConfigSection("profile_kwargs", ProfileKwargs, help="ProfileKwargs (accelerator.profile())"),
    ConfigSection("preemption", PreemptionConfig, help="PreemptionConfig (torchrig: checkpoint and stop on a signal)"),
    ConfigSection("training_guard", TrainingGuardConfig, help="TrainingGuardConfig (torchrig: skip or stop on a "
                  "NaN/inf or spiking loss or gradient norm)"),
    ConfigSection("launch", LaunchOptions, help="LaunchOptions (torchrig: the log folders torchrig launch keeps)"),
    ConfigSection("throughput_monitor", ThroughputMonitorConfig, help="ThroughputMonitorConfig (torchrig: "
                  "samples/s, tokens/s, MFU, peak memory to the trackers)"),
    ConfigSection("parallelism_config", ParallelismConfig, help="ParallelismConfig (the device mesh: data, tensor, "
                  "context, pipeline parallel sizes)"),
    ConfigSection("dynamo_config", TorchDynamoPlugin, help="TorchDynamoPlugin (Accelerate's dynamo_config)",
                  default=TorchDynamoPlugin(backend="no")),
)

__all__ = [
    "CORE_SECTIONS",
    "PREEMPTION_SIGNALS",
    "PROFILER_ACTIVITIES",
    "BORROWED_AXES",
    "ELASTIC_AXES",
    "AutocastKwargs",
    "CoreOptions",
    "DataLoaderConfiguration",
    "GradScalerKwargs",
    "GradientAccumulationPlugin",
    "InitProcessGroupKwargs",
    "KwargsHandler",
    "LaunchOptions",
    "PARALLELISM_AXES",
    "PP_SCHEDULES",
    "ParallelismConfig",
    "PreemptionConfig",
    "ProfileKwargs",
    "ProjectConfiguration",
    "TP_STYLES",
    "ThroughputMonitorConfig",
    "TorchDynamoPlugin",
    "TorchTensorParallelPlugin",
    "default_elastic_axis",
    "TrainingGuardConfig",
]
