"""Built-in cluster environments: where a process sits in the job, read from its environment.

``torchrig_detect_cluster`` is a firstresult hook asked of the cluster plugins in descending
priority; a plugin answers only when it recognises the environment, otherwise it returns
``None`` and the next one is asked. Setting the ``cluster`` option (``cluster: slurm``) registers
only that plugin: the explicit override, and the off switch for auto-detection.

========  ============  ========================================  ==================================================
priority  plugin        recognises                                declines (returns ``None``) when
========  ============  ========================================  ==================================================
50        torchelastic  ``RANK LOCAL_RANK WORLD_SIZE``            one of its variables is missing
                        ``MASTER_ADDR MASTER_PORT`` (torchrun,
                        ``torchrig launch``)
40        slurm         an ``srun`` task: ``SLURM_JOB_ID``,       torch elastic started the workers (its variables
                        ``SLURM_PROCID`` and a regular            and ``TORCHELASTIC_RUN_ID``); the batch script or
                        ``SLURM_STEP_ID``                         an ``salloc`` shell (no step, or the batch,
                                                                  interactive or extern step); ``SLURM_JOB_NAME`` is
                                                                  ``bash`` or ``interactive``; an MPI launcher's
                                                                  rank disagrees with ``SLURM_PROCID``
30        mpi           ``OMPI_COMM_WORLD_*`` (Open MPI),         no MPI rank variable; raises ``ValueError`` when
                        ``MV2_COMM_WORLD_*`` (MVAPICH2),          ``MASTER_ADDR``/``MASTER_PORT`` are not exported
                        ``PMI_RANK PMI_SIZE`` (MPICH, Intel MPI)
-100      local         always: one process, rank 0 of 1          never
trylast   core default  always: one process, rank 0 of 1          never
========  ============  ========================================  ==================================================

Why this order:

* **torchelastic first.** When ``torchrun`` / ``torchrig launch`` runs inside an ``srun`` task
  (one agent per node) or under ``mpirun``, the workers inherit the launcher's ``SLURM_*`` /
  ``OMPI_*`` variables, which describe the *agent* (``SLURM_PROCID`` is the node's index,
  ``SLURM_NTASKS`` the number of nodes); only elastic's variables describe the worker. The slurm
  plugin also declines on its own when elastic's variables and ``TORCHELASTIC_RUN_ID`` are present,
  so ``cluster: slurm`` cannot misread such a worker either.
* **slurm before mpi.** ``srun --mpi=pmi2`` starts each rank itself and sets ``PMI_RANK``/``PMI_SIZE``
  equal to ``SLURM_PROCID``/``SLURM_NTASKS``: Slurm describes that process completely (the
  rendezvous comes from the node list), while MPI alone would demand ``MASTER_ADDR``. Conversely,
  under ``mpirun`` inside an allocation Slurm started only the MPI daemons (one task per node), so
  the MPI rank disagrees with ``SLURM_PROCID``/``SLURM_NTASKS`` and slurm declines: mpi answers.
* **local last**, below every real environment: it never wins auto-detection over them. Its
  purpose is the explicit ``cluster: local``, which registers it alone so that leftover
  ``RANK``/``WORLD_SIZE``/``SLURM_*`` variables are ignored and the script runs as one process.
  In auto-detection it is asked only after every real environment declined, and then answers
  exactly what the core default would (rank 0 of 1), with ``source="local"``.

Hand-off: where Slurm or MPI should start the ranks (:func:`slurm_launch_mode`,
:func:`mpi_hands_off`), the plugins' runtime classes in :mod:`torchrig.launch.handoff` (these
classes plus the launcher's hooks) run the command lines of :mod:`torchrig.builtins.handoff`
(:func:`srun_command` and :func:`mpirun_command` are re-exported here). Slurm's compressed host lists are expanded by
:func:`expand_hostlist`. Nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence

from torchrig.builtins.handoff import mpirun_command, srun_command
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import ClusterInfo, LaunchPlan

# --------------------------------------------------------------------------------------------
# torchelastic
# --------------------------------------------------------------------------------------------

#: Set by torch elastic for every worker it starts.
ELASTIC_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: Set by torch elastic's agent (``torchrun``, ``torchrig launch``) for every worker; the mark that
#: elastic, not a user's ``export RANK=...``, started this process.
ELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"


class TorchElasticCluster:
    @hookimpl
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo | None:
        if not all(name in environ for name in ELASTIC_VARIABLES):
            return None
        try:
            world_size = int(environ["WORLD_SIZE"])
            local_world_size = int(environ.get("LOCAL_WORLD_SIZE", world_size))
            return ClusterInfo(
                rank=int(environ["RANK"]),
                local_rank=int(environ["LOCAL_RANK"]),
                world_size=world_size,
                local_world_size=local_world_size,
                node_rank=int(environ.get("GROUP_RANK", 0)),
                num_nodes=max(1, world_size // max(local_world_size, 1)),
                master_addr=environ["MASTER_ADDR"],
                master_port=int(environ["MASTER_PORT"]),
                source="torchelastic",
            )
        except ValueError as exc:
            raise ValueError(f"torch elastic variables are malformed ({exc}): "
                             + ", ".join(f"{v}={environ.get(v)!r}" for v in ELASTIC_VARIABLES)) from exc


def started_by_elastic(environ: Mapping[str, str]) -> bool:
    """True when torch elastic started this process: all of its worker variables and its run id."""
    return all(name in environ for name in ELASTIC_VARIABLES) and ELASTIC_RUN_ID in environ


# --------------------------------------------------------------------------------------------
# Shared parsing helpers: every malformed value is a ValueError naming the variable.
# --------------------------------------------------------------------------------------------


def _int_var(environ: Mapping[str, str], name: str, plugin: str, *, minimum: int = 0) -> int:
    raw = environ.get(name)
    if raw is None:
        raise ValueError(f"{plugin}: {name} is not set")
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{plugin}: {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{plugin}: {name}={raw!r} must be >= {minimum}")
    return value


def _port_var(environ: Mapping[str, str], name: str, plugin: str) -> int:
    port = _int_var(environ, name, plugin, minimum=1)
    if port > 65535:
        raise ValueError(f"{plugin}: {name}={environ[name]!r} is not a TCP port (1-65535)")
    return port


def _check_ranks(plugin: str, rank: tuple[str, int], size: tuple[str, int]) -> None:
    (rank_name, rank_value), (size_name, size_value) = rank, size
    if not 0 <= rank_value < size_value:
        raise ValueError(f"{plugin}: {rank_name}={rank_value} is not below {size_name}={size_value}")


# --------------------------------------------------------------------------------------------
# Slurm
# --------------------------------------------------------------------------------------------

#: ``SLURM_JOB_NAME`` values of interactive shells (``salloc``'s interactive step, ``srun --pty
#: bash``): Lightning's rule. Python started from such a shell is not an srun task of a training
#: step, even though it inherits the shell's own task variables. To run a multi-task ``srun``
#: step from an interactive allocation, give the allocation a name (``salloc -J train``).
SLURM_INTERACTIVE_JOB_NAMES = frozenset({"bash", "interactive"})

#: Step ids above this are Slurm's special steps (batch script, extern, interactive, pending).
SLURM_MAX_NORMAL_STEP_ID = 0xFFFFFFF0
_SLURM_SPECIAL_STEP_NAMES = frozenset({"batch", "extern", "interactive", "pending"})

#: Deterministic rendezvous port when ``MASTER_PORT`` is not set:
#: ``SLURM_PORT_BASE + SLURM_JOB_ID % SLURM_PORT_SPAN``, i.e. 10000-29999. Every task of a job
#: computes the same port without communicating; the range is unprivileged and below Linux's
#: ephemeral range (32768-60999), so an outgoing connection's port rarely takes it. Two jobs
#: whose ids differ by a multiple of 20000 and share the first node, or two concurrent steps of
#: one job, would collide: set ``MASTER_PORT`` for those.
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000


def slurm_master_port(job_id: int) -> int:
    """The rendezvous port derived from a Slurm job id: ``10000 + job_id % 20000``."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


_HOST_ITEM = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _split_top_level(hostlist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(hostlist):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in host list {hostlist!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {hostlist!r}")
        elif char == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in host list {hostlist!r}")
    items.append(hostlist[start:])
    return items


#: One bracket group: inclusive ``(low, high, width)`` ranges, expanded lazily.
_Ranges = tuple[tuple[int, int, int], ...]


def _parse_ranges(body: str, hostlist: str) -> _Ranges:
    """``"01-03,07"`` → ``((1, 3, 2), (7, 7, 2))``; zero padding follows the low bound's width."""
    out = []
    for piece in body.split(","):
        piece = piece.strip()
        match = _RANGE.fullmatch(piece)
        if not match:
            raise ValueError(f"bad range {piece!r} in host list {hostlist!r} (expected N or N-M)")
        low_text, high_text = match.group(1), match.group(2)
        low, high = int(low_text), int(high_text if high_text is not None else low_text)
        if high < low:
            raise ValueError(f"descending range {piece!r} in host list {hostlist!r}")
        out.append((low, high, len(low_text)))
    return tuple(out)


def _parse_hostlist(hostlist: str) -> list[list[str | _Ranges]]:
    """Each top-level item as its segments: literal text, or a bracket group's ranges."""
    if not hostlist or not hostlist.strip():
        raise ValueError("empty host list")
    parsed = []
    for item in _split_top_level(hostlist.strip()):
        item = item.strip()
        if not item:
            raise ValueError(f"empty host name in host list {hostlist!r}")
        segments: list[str | _Ranges] = []
        position = 0
        for match in _HOST_ITEM.finditer(item):
            segments.append(item[position:match.start()])
            segments.append(_parse_ranges(match.group(1), hostlist))
            position = match.end()
        segments.append(item[position:])
        if any(isinstance(seg, str) and ("[" in seg or "]" in seg) for seg in segments):
            raise ValueError(f"unbalanced brackets in host list {hostlist!r}")
        parsed.append(segments)
    return parsed


def _iter_segment(segment: str | _Ranges) -> Iterator[str]:
    if isinstance(segment, str):
        yield segment
        return
    for low, high, width in segment:
        for number in range(low, high + 1):
            yield f"{number:0{width}d}"


def _iter_product(segments: Sequence[str | _Ranges]) -> Iterator[str]:
    """Left-most group outermost, like ``scontrol show hostnames``; nothing is materialised."""
    if not segments:
        yield ""
        return
    for head in _iter_segment(segments[0]):
        for tail in _iter_product(segments[1:]):
            yield head + tail


def iter_hostlist(hostlist: str) -> Iterator[str]:
    """Expand a Slurm host list lazily (the whole string is validated first), so taking the
    first host of ``n[0000000-9999999]`` costs nothing."""
    parsed = _parse_hostlist(hostlist)
    for segments in parsed:
        yield from _iter_product(segments)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm compressed host list, like ``scontrol show hostnames``.

    ``"node[01-03,07],gpu-a1"`` → ``node01 node02 node03 node07 gpu-a1``. Commas separate hosts at
    the top level and ranges inside brackets; a range keeps the zero padding of its low bound
    (``[08-10]`` → ``08 09 10``); several bracket groups in one name expand left to right
    (``r[1-2]n[1-2]`` → ``r1n1 r1n2 r2n1 r2n2``). Malformed lists raise ``ValueError``.
    """
    return list(iter_hostlist(hostlist))


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` syntax: ``"4(x2),3"`` → ``[4, 4, 3]``."""
    out: list[int] = []
    for piece in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", piece)
        if not match:
            raise ValueError(f"bad tasks-per-node entry {piece!r} in {value!r} (expected N or N(xR))")
        count, repeats = int(match.group(1)), int(match.group(2) or 1)
        if repeats < 1:
            raise ValueError(f"bad repeat count in {piece!r} of {value!r}")
        out.extend([count] * repeats)
    return out


def _mpi_rank_and_size(environ: Mapping[str, str]) -> tuple[str, str, str, str] | None:
    """``(rank var, rank, size var, size)`` of the first MPI launcher whose variables are set."""
    for flavour in _MPI_FLAVOURS:
        if flavour.rank in environ:
            return flavour.rank, environ[flavour.rank], flavour.size, environ.get(flavour.size, "")
    return None


def _slurm_step_is_regular(environ: Mapping[str, str]) -> bool:
    """A step started by ``srun`` (not the batch script, extern or interactive step)."""
    name = "SLURM_STEP_ID" if "SLURM_STEP_ID" in environ else "SLURM_STEPID"
    raw = environ.get(name)
    if raw is None:
        return False
    text = raw.strip()
    if text.lower() in _SLURM_SPECIAL_STEP_NAMES:
        return False
    try:
        step = int(text)
    except ValueError:
        raise ValueError(f"slurm: {name}={raw!r} is not a step id") from None
    return 0 <= step <= SLURM_MAX_NORMAL_STEP_ID


class SlurmCluster:
    """One process per ``srun`` task (``srun python -u train.py``).

    - rank ``SLURM_PROCID``; local rank ``SLURM_LOCALID``; node rank ``SLURM_NODEID``;
    - world size ``SLURM_STEP_NUM_TASKS``, else ``SLURM_NTASKS`` (``SLURM_NPROCS``);
    - nodes ``SLURM_STEP_NUM_NODES``, else ``SLURM_NNODES``, else ``SLURM_JOB_NUM_NODES``;
    - tasks on this node: entry ``SLURM_NODEID`` of ``SLURM_STEP_TASKS_PER_NODE`` /
      ``SLURM_TASKS_PER_NODE`` (``"4(x2),3"``) when it matches the step, else
      ``SLURM_NTASKS_PER_NODE``, else world size / nodes;
    - master address ``MASTER_ADDR``, else the first host of ``SLURM_STEP_NODELIST`` (else
      ``SLURM_NODELIST``, ``SLURM_JOB_NODELIST``): task 0 runs there under block, cyclic and
      plane distributions; with ``--distribution=arbitrary`` set ``MASTER_ADDR`` yourself;
    - master port ``MASTER_PORT``, else :func:`slurm_master_port` of ``SLURM_JOB_ID``.
    """

    name = "slurm"

    @hookimpl
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo | None:
        return detect_slurm(environ)

    @hookimpl
    def torchrig_requeue_command(self, environ: Mapping[str, str]) -> list[str] | None:
        """``scontrol requeue <job>`` for any process of a Slurm job (batch script, ``srun``
        task, or a rank ``srun torchrig launch`` started): the job is what goes back in the queue."""
        job = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        return ["scontrol", "requeue", job] if job else None


def slurm_launch_mode(plan: LaunchPlan, environ: Mapping[str, str]) -> str | None:
    """What ``torchrig launch`` does with Slurm: ``"srun"`` in a job's batch script or ``salloc``
    shell (one step over the allocation, one task per rank); ``"sbatch"`` outside any job when
    ``cluster: slurm`` is configured (submit a batch script); ``None`` — torch elastic starts the
    workers — in an ``srun`` task (``srun torchrig launch``: this launcher is the node's agent),
    under torch elastic, and outside a job without ``cluster: slurm``."""
    if "SLURM_JOB_ID" not in environ and "SLURM_JOBID" not in environ:
        return "sbatch" if plan.cluster == "slurm" else None
    if _slurm_step_is_regular(environ) or started_by_elastic(environ):
        return None
    return "srun"


def slurm_task_recognised(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` is an ``srun`` task that the slurm plugin describes (see the module table)."""
    if "SLURM_JOB_ID" not in environ and "SLURM_JOBID" not in environ:
        return False
    if started_by_elastic(environ):
        return False  # torchrun / torchrig launch inside the allocation started this worker
    if "SLURM_PROCID" not in environ or not _slurm_step_is_regular(environ):
        return False  # the batch script or an salloc shell: not an srun task
    if environ.get("SLURM_JOB_NAME", "").strip() in SLURM_INTERACTIVE_JOB_NAMES:
        return False
    mpi = _mpi_rank_and_size(environ)
    if mpi is not None:
        # mpirun / mpiexec inside the allocation: Slurm started its daemons (one task per
        # node), not this rank. srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE equal to Slurm's.
        _, rank, _, size = mpi
        slurm_size = environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS", ""))
        if (rank.strip(), size.strip()) != (environ["SLURM_PROCID"].strip(), slurm_size.strip()):
            return False
    return True


def detect_slurm(environ: Mapping[str, str]) -> ClusterInfo | None:
    """The slurm plugin's answer for ``environ`` (``None`` when it is not an srun task)."""
    if not slurm_task_recognised(environ):
        return None
    p = "slurm"
    rank = _int_var(environ, "SLURM_PROCID", p)
    world_var = next((n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if n in environ), "SLURM_NTASKS")
    world_size = _int_var(environ, world_var, p, minimum=1)
    _check_ranks(p, ("SLURM_PROCID", rank), (world_var, world_size))
    nodes_var = next((n for n in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") if n in environ),
                     "SLURM_NNODES")
    num_nodes = _int_var(environ, nodes_var, p, minimum=1)
    node_rank = _int_var(environ, "SLURM_NODEID", p)
    _check_ranks(p, ("SLURM_NODEID", node_rank), (nodes_var, num_nodes))
    local_rank = _int_var(environ, "SLURM_LOCALID", p)
    local_var, local_world_size = _slurm_local_world_size(environ, node_rank, num_nodes, world_size)
    _check_ranks(p, ("SLURM_LOCALID", local_rank), (local_var, local_world_size))

    master_addr: str | None = None
    master_port: int | None = None
    if world_size > 1:
        master_addr = environ.get("MASTER_ADDR", "").strip() or _slurm_first_host(environ)
        if "MASTER_PORT" in environ:
            master_port = _port_var(environ, "MASTER_PORT", p)
        else:
            job_var = "SLURM_JOB_ID" if "SLURM_JOB_ID" in environ else "SLURM_JOBID"
            master_port = slurm_master_port(_int_var(environ, job_var, p))
    return ClusterInfo(
        rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size,
        node_rank=node_rank, num_nodes=num_nodes, master_addr=master_addr, master_port=master_port, source="slurm",
    )


def _slurm_local_world_size(environ: Mapping[str, str], node_rank: int, num_nodes: int, world_size: int) -> tuple[str, int]:
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if name in environ:
            try:
                counts = parse_tasks_per_node(environ[name])
            except ValueError as exc:
                raise ValueError(f"slurm: {name}={environ[name]!r} is malformed: {exc}") from None
            # The allocation's layout (inherited with srun --preserve-env) may not be the step's.
            if len(counts) == num_nodes and sum(counts) == world_size:
                return name, counts[node_rank]
    if "SLURM_NTASKS_PER_NODE" in environ:
        per_node = _int_var(environ, "SLURM_NTASKS_PER_NODE", "slurm", minimum=1)
        if per_node * num_nodes == world_size:
            return "SLURM_NTASKS_PER_NODE", per_node
    if world_size % num_nodes == 0:
        return "the tasks per node", world_size // num_nodes
    raise ValueError(
        f"slurm: cannot tell how many tasks run on node {node_rank}: {world_size} tasks on {num_nodes} nodes and "
        "SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE do not describe the step"
    )


def _slurm_first_host(environ: Mapping[str, str]) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
        if name in environ:
            try:
                return next(iter_hostlist(environ[name]))
            except ValueError as exc:
                raise ValueError(f"slurm: {name}={environ[name]!r} is malformed: {exc}") from None
    raise ValueError("slurm: MASTER_ADDR is not set and neither is SLURM_STEP_NODELIST, SLURM_NODELIST "
                     "or SLURM_JOB_NODELIST to take the first host from; export MASTER_ADDR=<host of task 0>")


# --------------------------------------------------------------------------------------------
# MPI
# --------------------------------------------------------------------------------------------


class _MPIFlavour:
    __slots__ = ("name", "rank", "size", "local_rank", "local_size", "export_hint")

    def __init__(self, name: str, rank: str, size: str, local_rank: str, local_size: str, export_hint: str) -> None:
        self.name, self.rank, self.size = name, rank, size
        self.local_rank, self.local_size, self.export_hint = local_rank, local_size, export_hint


_MPI_FLAVOURS = (
    _MPIFlavour("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> ..."),
    _MPIFlavour("MVAPICH2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                "MV2_COMM_WORLD_LOCAL_SIZE", "mpirun_rsh ... MASTER_ADDR=<host of rank 0> MASTER_PORT=<free port> python ..."),
    _MPIFlavour("MPICH / Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                "mpiexec -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT <free port> ..."),
)


class MPICluster:
    """One process per MPI rank, started by ``mpirun``/``mpiexec`` (no MPI library is imported).

    - Open MPI: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
    - MVAPICH2: ``MV2_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
    - MPICH / Intel MPI (hydra): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.

    MPI does not say which node index a process is on (Open MPI's ``OMPI_COMM_WORLD_NODE_RANK``
    is a rank *within* the node, not the node's index), so ``node_rank = (rank - local_rank) //
    local_size`` and ``num_nodes = ceil(size / local_size)``: exact for the default placement
    (consecutive ranks fill a node: ``--map-by slot``, hydra's block placement) with the same
    number of ranks per node; informational otherwise (torchrig itself needs only the ranks,
    sizes and rendezvous). The rendezvous cannot be derived: ``MASTER_ADDR`` and
    ``MASTER_PORT`` must be exported to every rank (``mpirun -x``); when they are missing the
    plugin raises a ``ValueError`` saying what to export.
    """

    name = "mpi"

    @hookimpl
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo | None:
        return detect_mpi(environ)


def mpi_hands_off(plan: LaunchPlan, environ: Mapping[str, str]) -> bool:
    """``cluster: mpi`` configured, and this launcher is not itself an MPI rank (``mpirun torchrig launch``)."""
    return plan.cluster == "mpi" and _mpi_rank_and_size(environ) is None


def detect_mpi(environ: Mapping[str, str]) -> ClusterInfo | None:
    """The mpi plugin's answer for ``environ`` (``None`` when no MPI launcher started it)."""
    flavour = next((f for f in _MPI_FLAVOURS if f.rank in environ), None)
    if flavour is None:
        return None
    p = "mpi"
    rank = _int_var(environ, flavour.rank, p)
    world_size = _int_var(environ, flavour.size, p, minimum=1)
    _check_ranks(p, (flavour.rank, rank), (flavour.size, world_size))
    missing_local = [n for n in (flavour.local_rank, flavour.local_size) if n not in environ]
    if missing_local:
        raise ValueError(
            f"mpi: {flavour.rank} is set ({flavour.name}) but {' and '.join(missing_local)} "
            f"{'is' if len(missing_local) == 1 else 'are'} not, so this process's local rank is unknown; "
            "start the ranks with the MPI launcher (mpirun / mpiexec), or with srun under the slurm plugin"
        )
    local_rank = _int_var(environ, flavour.local_rank, p)
    local_world_size = _int_var(environ, flavour.local_size, p, minimum=1)
    _check_ranks(p, (flavour.local_rank, local_rank), (flavour.local_size, local_world_size))
    if local_world_size > world_size:
        raise ValueError(f"mpi: {flavour.local_size}={local_world_size} exceeds {flavour.size}={world_size}")
    num_nodes = -(-world_size // local_world_size)
    node_rank = max(0, rank - local_rank) // local_world_size

    master_addr: str | None = None
    master_port: int | None = None
    if world_size > 1:
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(n, "").strip()]
        if missing:
            raise ValueError(
                f"mpi: this process is rank {rank} of {world_size} started by {flavour.name} ({flavour.rank}), "
                f"but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: torchrig needs the "
                "address and port of rank 0 to join the process group. Export both to every rank, e.g. "
                f"`{flavour.export_hint}` (torchrig.builtins.clusters.mpirun_command builds the Open MPI line)"
            )
        master_addr = environ["MASTER_ADDR"].strip()
        master_port = _port_var(environ, "MASTER_PORT", p)
    return ClusterInfo(
        rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size,
        node_rank=node_rank, num_nodes=num_nodes, master_addr=master_addr, master_port=master_port, source="mpi",
    )


# --------------------------------------------------------------------------------------------
# local
# --------------------------------------------------------------------------------------------


class LocalCluster:
    """One process, rank 0 of 1, whatever the environment says.

    For ``cluster: local``: running a script single-process inside an environment with
    ``RANK``/``WORLD_SIZE`` or ``SLURM_*`` leftovers (an ``srun`` shell, a notebook started by a
    launcher). Its priority is the lowest, so in auto-detection it answers only after every
    real environment declined, with what the core default would answer.
    """

    name = "local"

    @hookimpl
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo:
        return ClusterInfo(source="local")


__all__ = [
    "ELASTIC_RUN_ID",
    "ELASTIC_VARIABLES",
    "LocalCluster",
    "MPICluster",
    "SLURM_INTERACTIVE_JOB_NAMES",
    "SlurmCluster",
    "TorchElasticCluster",
    "detect_mpi",
    "detect_slurm",
    "expand_hostlist",
    "iter_hostlist",
    "mpi_hands_off",
    "mpirun_command",
    "parse_tasks_per_node",
    "slurm_launch_mode",
    "slurm_master_port",
    "slurm_task_recognised",
    "srun_command",
    "started_by_elastic",
]
