"""Plain data exchanged through hooks. Torch-free: the launcher and the CLI import it too.

Objects that carry torch values (models, optimizers) are typed with strings so that importing
this module never imports torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import attrs

T = TypeVar("T")


@attrs.frozen
class ClusterInfo:
    """Where this process sits in the job. Answered by a cluster-environment plugin.

    ``master_addr``/``master_port`` are the rendezvous endpoint of the default process group;
    ``None`` when the job has one process.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    #: Name of the cluster plugin that answered (``"default"`` for the core fallback).
    source: str = "default"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_rank == 0


@attrs.frozen
class Capabilities:
    """What the core must know about a strategy beyond its step-plan slots. Declared once at
    prepare.

    Which phases a strategy performs is declared by filling the step plan's slots
    (``torchrig_strategy_step_plan``: implementing a slot is owning it — backward, optimizer
    step, clipping…), and how it checkpoints by implementing the checkpoint hooks. Only what
    the core, or another plugin through ``run.capabilities`` (the fp8 precision reads
    ``fully_shard_parameters``), reads is here; neither asks *which* strategy is running.
    """

    #: The strategy counts micro-steps itself and steps only at accumulation boundaries (the
    #: core's ``accumulate()`` then neither skips optimizer steps nor enters ``no_sync``).
    owns_accumulation: bool = False
    #: The micro-steps per optimizer step the strategy's own configuration fixes (DeepSpeed:
    #: ``deepspeed_config.gradient_accumulation_steps``, or a number in its JSON), or None. The
    #: core owns the run's count: it adopts this value at ``prepare`` when the run left
    #: ``gradient_accumulation_steps`` at its default (no source set it, 1), so ``accumulate()``
    #: counts what the engine counts; an explicit setting stands. The strategy then reads the
    #: run's count (:data:`ACCUMULATION_STATE`) to build its engine — it never writes it.
    accumulation_steps: int | None = None
    #: The strategy applies mixed precision itself; the precision plugin's step-plan hook is
    #: not called, and the strategy reads ``mixed_precision`` from the config.
    owns_precision: bool = False
    #: Every rank holds every parameter in full (a replica, not a shard), so parameters can be
    #: averaged across ranks in place (``LocalSGD``). False for sharding engines (FSDP, DeepSpeed ZeRO).
    replicated_parameters: bool = False
    #: Parameters are sharded with torch's ``fully_shard`` (FSDP2): a parameter whose tensor
    #: subclass implements ``fsdp_pre_all_gather``/``fsdp_post_all_gather`` (torchao's fp8
    #: weights) is all-gathered in the dtype the subclass chooses. False for replicas (DDP) and
    #: for engines that shard their own way (DeepSpeed ZeRO).
    fully_shard_parameters: bool = False
    #: Ranks that see different data. Data-parallel strategies: every rank.
    data_parallel_size: int | None = None
    data_parallel_rank: int | None = None
    #: The run's ``torch.distributed.device_mesh.DeviceMesh`` when the strategy built one (named
    #: axes: ``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``); ``accelerator.torch_device_mesh`` returns it.
    device_mesh: Any = None
    #: Named sub-meshes of ``device_mesh``, flattened ones included (``dp``, ``dp_shard_cp``,
    #: ``dp_cp``): torch deprecates slicing a flattened axis from the root, so they are kept here.
    device_submeshes: Mapping[str, Any] = attrs.field(factory=dict)
    #: When some ranks share batches (tensor parallel, context parallel, pipeline stages): the process group of the data-parallel
    #: ranks this rank belongs to, one rank per data-parallel rank, in data-parallel order.
    #: ``gather_for_metrics`` gathers over it, so every sample is counted once. None: the world.
    data_parallel_group: Any = None


@attrs.frozen
class ConfigSection:
    """A plugin's own configuration section, e.g. ``fsdp_config`` with the FSDP options class.

    ``options`` is the attrs options class, or its ``"module:Class"`` reference (entry-point
    syntax, naming the module that defines it): a referenced class is imported only when a run
    uses the section, so an installed plugin a run does not select costs it no import of its
    options. ``aliases`` are other keys accepted for the same section (Accelerate's spellings).
    """

    key: str
    options: type | str
    aliases: tuple[str, ...] = ()
    help: str = ""
    #: Values used when no source sets a key, if they differ from ``options()``'s own defaults
    #: (``dynamo_config`` compiles nothing unless configured, yet ``TorchDynamoPlugin()`` in a
    #: script means inductor).
    default: Any = None


@attrs.frozen
class CliFlag:
    """A command-line flag a plugin contributes to ``torchrig launch``.

    The flag sets the config value at ``key`` (a dotted path), so flags, files and environment
    variables share one precedence order and one validation.
    """

    flag: str = attrs.field()
    key: str = attrs.field()
    help: str = ""
    #: ``"str"``, ``"int"``, ``"float"``, ``"bool"`` (``--x``/``--x false``), ``"list"`` (comma
    #: separated) or ``"const"`` (a switch storing ``const``).
    type: str = attrs.field(default="str", validator=attrs.validators.in_(("str", "int", "float", "bool", "list", "const")))
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    #: For a switch that stores a fixed value (``--use_fsdp`` stores ``"fsdp"`` into ``strategy``).
    const: Any = None

    @flag.validator
    def _check_flag(self, attribute: attrs.Attribute, value: str) -> None:
        if not value.startswith("--") or len(value) < 3:
            raise ValueError(f"CLI flag {value!r} must start with '--'")


@attrs.frozen
class ConfigProblem:
    """One validation problem: the dotted ``key`` it concerns and what to do about it."""

    key: str
    message: str
    #: ``"file:line"`` when known.
    where: str | None = None

    def __str__(self) -> str:
        where = f" ({self.where})" if self.where else ""
        return f"{self.key}{where}: {self.message}"


@attrs.define(eq=False)
class PreparedModel:
    """What a strategy returns from ``torchrig_prepare_model``.

    ``model`` is what the user calls forward on (a DDP module, an FSDP2 module, a DeepSpeed
    engine); ``unwrapped`` is the user's own module (``unwrap_model`` returns it);
    ``optimizers``/``schedulers`` are positionally the ones passed in, possibly replaced
    (DeepSpeed returns its own optimizer; FSDP2 remaps param groups in place).
    """

    model: Any
    unwrapped: Any
    optimizers: list[Any] = attrs.field(factory=list)
    schedulers: list[Any] = attrs.field(factory=list)


@attrs.frozen
class LaunchPlan:
    """Everything needed to start the workers of one node. Built by ``torchrig launch``."""

    #: The command each worker runs: ``[sys.executable, "-u", script, *args]`` or a binary.
    #: ``torchrig launch`` passes its per-rank wrapper (``python -u -m torchrig.launch.worker
    #: ... -- script args``), which records each rank's fate in ``log_dir``.
    command: Sequence[str]
    nproc_per_node: int = 1
    num_nodes: int = 1
    #: Elastic world size: the fewest nodes the rendezvous accepts (None: exactly ``num_nodes``).
    min_nodes: int | None = None
    node_rank: int = 0
    #: ``c10d``, ``static``, or ``local``: one machine, no rendezvous round (the launcher's
    #: default there; see ``torchrig.launch.rendezvous.SingleNodeRendezvous``).
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "127.0.0.1:0"
    run_id: str = "torchrig"
    max_restarts: int = 0
    monitor_interval: float = 0.1
    #: Where status files (``rank-N.status.json``, ``run_status.json``) and per-rank logs go;
    #: None: a fresh temporary directory.
    log_dir: str | None = None
    env: Mapping[str, str] = attrs.field(factory=dict)
    #: Streams copied to ``<log_dir>/attempt-K/rank-N.{stdout,stderr}.log`` and printed with a
    #: ``[rankN]: `` prefix: 0 none (workers write to the console directly), 1 stdout, 2 stderr, 3 both.
    tee: int = 3
    #: Seconds workers get to stop after the launcher forwards SIGTERM/SIGINT, before SIGKILL.
    shutdown_grace_s: float = 10.0
    #: Address the workers use to reach the machine of rank 0 (``main_process_ip``); None:
    #: 127.0.0.1 on one machine, else the rendezvous endpoint's host.
    master_addr: str | None = None
    #: Extra rendezvous options for torch elastic (``join_timeout``, ``read_timeout``...).
    rdzv_configs: Mapping[str, Any] = attrs.field(factory=dict)
    #: Problems found before the launch that did not stop it; repeated in the summary.
    warnings: Sequence[str] = ()
    #: The user's own command, without torchrig's per-rank wrapper (``[python, "-u", script,
    #: *args]``, ``[python, "-u", "-m", module, ...]`` or the ``--no_python`` command): what a
    #: cluster's launcher (``srun``, ``mpirun``) starts once per rank, on nodes where the
    #: launcher's pid means nothing.
    script_command: Sequence[str] = ()
    #: The ``cluster`` option as configured (``None``: auto-detected), so that a cluster plugin
    #: hands off only where asked to (``--cluster slurm`` outside an allocation submits a job).
    cluster: str | None = None
    #: The resolved configuration (a :class:`torchrig.config.resolve.ResolvedConfig`): a launching
    #: plugin reads its own section from it (``plan.config.section_of(SlurmOptions)``).
    config: Any = attrs.field(default=None, eq=False, repr=False)
    #: ``torchrig launch --dry-run``: print what would be started (a cluster plugin: the
    #: ``sbatch`` script or ``mpirun`` line) and start nothing.
    dry_run: bool = False


class StashKey(Generic[T]):
    """A typed key for :class:`Stash`: plugins keep per-run state under their own keys."""

    __slots__ = ("name",)

    def __init__(self, name: str = "") -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StashKey({self.name!r})"


class Stash:
    """Per-run storage for plugin state (instead of module globals or singletons).

    A plugin defines ``KEY = StashKey[DeviceMesh]("fsdp.mesh")`` and stores
    ``run.stash[KEY] = mesh``; keys are objects, so two plugins never collide.
    """

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[StashKey[Any], Any] = {}

    def __setitem__(self, key: StashKey[T], value: T) -> None:
        self._data[key] = value

    def __getitem__(self, key: StashKey[T]) -> T:
        return self._data[key]

    def get(self, key: StashKey[T], default: T | None = None) -> T | None:
        return self._data.get(key, default)

    def setdefault(self, key: StashKey[T], default: T) -> T:
        return self._data.setdefault(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __delitem__(self, key: StashKey[Any]) -> None:
        del self._data[key]

    def __len__(self) -> int:
        return len(self._data)


class AccumulationState(Protocol):
    """The run's gradient accumulation as a plugin may see it: read-only.

    The core writes it (``accumulate()``, the Accelerator's settings, the count a strategy
    declares in :attr:`Capabilities.accumulation_steps`); a strategy reads it where its engine
    must agree with the core — the count it builds the engine with, whether this micro-step
    ends a cycle (``sync_gradients``), whether schedulers follow optimizer steps.
    """

    @property
    def num_steps(self) -> int:
        """Micro-steps per optimizer step."""

    @property
    def sync_gradients(self) -> bool:
        """True on the micro-step that ends an accumulation cycle."""

    @property
    def adjust_scheduler(self) -> bool:
        """False: schedulers step on every call (a schedule written in micro-steps)."""

    @property
    def step_scheduler_with_optimizer(self) -> bool:
        """False: schedulers step on every call (``Accelerator(step_scheduler_with_optimizer=False)``)."""


#: Where a run keeps the core's gradient-accumulation state (``run.stash[ACCUMULATION_STATE]``),
#: created with the Accelerator; typed read-only for plugins.
ACCUMULATION_STATE: StashKey[AccumulationState] = StashKey("torchrig.training.gradient_state")

#: A factory of context managers: ``with plan.autocast(): ...``
ContextFactory = Callable[[], Any]

__all__ = [
    "ACCUMULATION_STATE",
    "AccumulationState",
    "Capabilities",
    "CliFlag",
    "ClusterInfo",
    "ConfigProblem",
    "ConfigSection",
    "ContextFactory",
    "LaunchPlan",
    "PreparedModel",
    "Stash",
    "StashKey",
]
