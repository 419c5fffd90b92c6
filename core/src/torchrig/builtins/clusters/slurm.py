"""The ``slurm`` cluster environment (priority 40): every piece of Slurm in the core.

* **Detection** (every rank): :class:`SlurmCluster` reads an ``srun`` task's ``SLURM_*`` variables
  (:func:`detect_slurm`; when it declines: :mod:`torchrig.builtins.clusters`) and answers
  ``torchrig_requeue_command`` with ``scontrol requeue``.
* **Hand-off** (``torchrig launch``): :func:`slurm_launch_mode` says whether to run one ``srun`` step
  over the allocation (:func:`allocation_srun`, :func:`srun_command`) or to submit a batch script
  (:func:`sbatch_script`, :func:`submit`); :class:`SlurmLauncher`, the plugin's runtime object, is
  :class:`SlurmCluster` plus the launcher's hooks.

The host list and tasks-per-node parsers are :mod:`.slurm_hostlist`; the ``slurm`` configuration
section, which the torch-free manifests declare, is :class:`~.handoff_options.SlurmOptions`. Running
``srun`` and recording the outcome goes through :mod:`torchrig.launch.handoff`, shared with MPI.
Torch-free.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence

from torchrig.builtins.clusters.cluster_environment import check_ranks, int_var, port_var
from torchrig.builtins.clusters.handoff_options import SlurmOptions, control_character, plan_is_set, plan_section
from torchrig.builtins.clusters.mpi import mpi_rank_and_size
from torchrig.builtins.clusters.slurm_hostlist import iter_hostlist, parse_tasks_per_node
from torchrig.builtins.clusters.torchelastic import started_by_elastic
from torchrig.launch.handoff import PROG, HandoffRefused, record_handoff, refuse, run_forwarding
from torchrig.launch.status import FAILED
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import ClusterInfo, LaunchPlan

# --------------------------------------------------------------------------------------------
# Detection: an srun task's place in the job
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
    mpi = mpi_rank_and_size(environ)
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
    rank = int_var(environ, "SLURM_PROCID", p)
    world_var = next((n for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS") if n in environ), "SLURM_NTASKS")
    world_size = int_var(environ, world_var, p, minimum=1)
    check_ranks(p, ("SLURM_PROCID", rank), (world_var, world_size))
    nodes_var = next((n for n in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES") if n in environ),
                     "SLURM_NNODES")
    num_nodes = int_var(environ, nodes_var, p, minimum=1)
    node_rank = int_var(environ, "SLURM_NODEID", p)
    check_ranks(p, ("SLURM_NODEID", node_rank), (nodes_var, num_nodes))
    local_rank = int_var(environ, "SLURM_LOCALID", p)
    local_var, local_world_size = _slurm_local_world_size(environ, node_rank, num_nodes, world_size)
    check_ranks(p, ("SLURM_LOCALID", local_rank), (local_var, local_world_size))

    master_addr: str | None = None
    master_port: int | None = None
    if world_size > 1:
        master_addr = environ.get("MASTER_ADDR", "").strip() or _slurm_first_host(environ)
        if "MASTER_PORT" in environ:
            master_port = port_var(environ, "MASTER_PORT", p)
        else:
            job_var = "SLURM_JOB_ID" if "SLURM_JOB_ID" in environ else "SLURM_JOBID"
            master_port = slurm_master_port(int_var(environ, job_var, p))
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
        per_node = int_var(environ, "SLURM_NTASKS_PER_NODE", "slurm", minimum=1)
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
# Hand-off: torchrig launch in an allocation (srun) or outside one (sbatch)
# --------------------------------------------------------------------------------------------

#: ``run_status.json``'s state after ``--cluster slurm`` submitted the job (Slurm runs it later).
SUBMITTED = "submitted"


def srun_command(
    nproc_per_node: int,
    num_nodes: int,
    command: Sequence[str],
    *,
    cpus_per_task: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """The ``srun`` command line that starts one Slurm task per training process.

    ``srun --nodes=N --ntasks-per-node=P --ntasks=N*P [--cpus-per-task=C] --kill-on-bad-exit=1
    *extra *command``. ``command`` is the user's command (:attr:`LaunchPlan.script_command`,
    ``[python, "-u", script, *args]``); every task runs it and the slurm plugin gives each its
    rank. ``--kill-on-bad-exit=1`` ends the step when one task fails, instead of leaving the
    others blocked in a collective. Run it inside an allocation (``sbatch``/``salloc``) of at
    least ``num_nodes`` nodes.
    """
    for name, value in (("nproc_per_node", nproc_per_node), ("num_nodes", num_nodes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"srun_command: {name} must be a positive integer, not {value!r}")
    if cpus_per_task is not None and (isinstance(cpus_per_task, bool) or not isinstance(cpus_per_task, int)
                                      or cpus_per_task < 1):
        raise ValueError(f"srun_command: cpus_per_task must be a positive integer, not {cpus_per_task!r}")
    if isinstance(command, str) or not command:
        raise ValueError("srun_command: command must be a non-empty list of arguments")
    args = ["srun", f"--nodes={num_nodes}", f"--ntasks-per-node={nproc_per_node}",
            f"--ntasks={num_nodes * nproc_per_node}"]
    if cpus_per_task is not None:
        args.append(f"--cpus-per-task={cpus_per_task}")
    args.append("--kill-on-bad-exit=1")
    return [*args, *extra, *command]


def _positive_var(environ: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = environ.get(name, "").strip()
        if raw:
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"slurm: {name}={raw!r} is not an integer") from None
            if value < 1:
                raise ValueError(f"slurm: {name}={raw!r} must be at least 1")
            return value
    return None


def allocation_srun(plan: LaunchPlan, environ: Mapping[str, str]) -> list[str]:
    """The ``srun`` line that runs the script over the allocation this batch script (or
    ``salloc`` shell) holds: nodes from ``num_machines`` when set, else the allocation's
    (``SLURM_JOB_NUM_NODES``); processes from ``num_processes`` when set, else the allocation's
    tasks (``SLURM_NTASKS``, what ``sbatch -n``/``--ntasks-per-node`` asked for), else one per
    node (or one per visible GPU)."""
    options = plan_section(plan, SlurmOptions)
    nodes = plan.num_nodes if plan_is_set(plan, "num_machines") else (
        _positive_var(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1)
    if plan_is_set(plan, "num_processes"):
        total = plan.nproc_per_node * plan.num_nodes
    else:
        total = _positive_var(environ, "SLURM_NTASKS", "SLURM_NPROCS") or plan.nproc_per_node * nodes
    if total % nodes:
        raise ValueError(f"slurm: {total} processes do not divide over the allocation's {nodes} nodes; set "
                         "num_processes (--num_processes) to a multiple of the nodes")
    cpus = options.cpus_per_task or _positive_var(environ, "SLURM_CPUS_PER_TASK")
    return srun_command(total // nodes, nodes, plan.script_command, cpus_per_task=cpus, extra=options.srun_args)


#: What sbatch's ``#SBATCH`` parser passes through unchanged, unquoted.
_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9_./=,:@%+-]+")
#: sbatch blanks out ``packjob`` (and splits het jobs at ``hetjob``) anywhere in an ``#SBATCH`` line.
_HETJOB_WORD = re.compile(r"(pack|het)(job)", re.IGNORECASE)
#: An environment variable name, the only thing written unquoted after ``export``.
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def sbatch_quote(option: str, what: str) -> str:
    """``option`` written so that sbatch's ``#SBATCH`` parser reads it back exactly.

    That parser (Slurm's ``get_argument``) splits a line on whitespace, groups with single or
    double quotes, drops a backslash and keeps the character after it, ends the line at an
    unquoted ``#``, and blanks ``packjob`` out of the whole line. So: plain options as they are;
    any other in double quotes with ``\\`` and ``"`` escaped and ``pack\\job``/``het\\job`` broken
    by an escape. A control character cannot be written (a line break would end the line and the
    rest would run as a command): :class:`HandoffRefused` names ``what``."""
    found = control_character(option)
    if found:
        raise HandoffRefused(f"{what} = {option!r} contains {found}, which cannot be written into the batch script's "
                             "#SBATCH lines (it would end the line and run the rest as a command); remove it")
    if _SBATCH_PLAIN.fullmatch(option) and not _HETJOB_WORD.search(option):
        return option
    escaped = re.sub(r'(["\\])', r"\\\1", option)
    return '"' + _HETJOB_WORD.sub(lambda match: f"{match.group(1)}\\{match.group(2)}", escaped) + '"'


def derived_job_name(plan: LaunchPlan) -> str:
    """``torchrig-<script name>`` with everything but letters, digits, ``.``, ``_`` and ``-`` made ``_``
    (a file name may hold spaces, quotes or line breaks; a job name shown by squeue should not)."""
    target = next((part for part in plan.script_command if not part.startswith("-") and part != sys.executable),
                  "job")
    stem = os.path.splitext(os.path.basename(target))[0] or "job"
    return "torchrig-" + re.sub(r"[^A-Za-z0-9._-]", "_", stem)


def default_output(log_dir: str) -> str:
    """``<log_dir>/slurm-%j.out`` with the directory's own ``%`` doubled (Slurm's literal percent), so
    only the file name's ``%j`` is a pattern. A backslash anywhere turns Slurm's patterns off for the
    whole name: then the file is ``slurm.out``, literally."""
    if "\\" in log_dir:
        return os.path.join(log_dir, "slurm.out")
    return os.path.join(log_dir.replace("%", "%%"), "slurm-%j.out")


def output_file(pattern: str, job: str) -> str:
    """The file Slurm writes for an ``--output`` of ``pattern`` (``%j`` and ``%%`` expanded; other
    patterns shown as they are)."""
    if "\\" in pattern:
        return pattern
    return re.sub(r"%(%|j)", lambda match: "%" if match.group(1) == "%" else job, pattern)


def _log_dir(plan: LaunchPlan) -> str:
    log_dir = plan.log_dir or os.getcwd()
    found = control_character(log_dir)
    if found:
        raise HandoffRefused(f"the log directory (--log_dir) {log_dir!r} contains {found}; the batch script names it "
                             "in its #SBATCH --output line, which cannot span lines: choose a directory without it")
    return log_dir


def sbatch_output(plan: LaunchPlan) -> str:
    """The job's ``--output``: ``slurm.output`` (Slurm's ``%`` patterns allowed), else :func:`default_output`."""
    return plan_section(plan, SlurmOptions).output or default_output(_log_dir(plan))


def sbatch_script(plan: LaunchPlan) -> str:
    """The batch script ``torchrig launch --cluster slurm`` submits: ``#SBATCH`` lines from the
    ``slurm`` section, ``num_machines`` and ``num_processes`` (and the ``preemption`` section:
    ``--signal=USR1@N``, ``--requeue``), the environment the workers need, and one ``srun`` step.

    Every value reaches sbatch or bash exactly: ``#SBATCH`` options through :func:`sbatch_quote`,
    the body's words through :func:`shlex.quote`; a value that cannot is refused
    (:class:`HandoffRefused`, naming it)."""
    options = plan_section(plan, SlurmOptions)
    config = plan.config
    signals = list(config.get("preemption.signals") or []) if config is not None else []
    requeue = bool(config.get("preemption.requeue")) if config is not None else False
    name = options.job_name or derived_job_name(plan)
    output = sbatch_output(plan)
    nodes, total = options.nodes or plan.num_nodes, plan.nproc_per_node * plan.num_nodes
    if total % nodes:
        raise ValueError(f"slurm: num_processes {total} does not divide over slurm.nodes {nodes}: each node runs "
                         "num_processes / nodes tasks")
    sbatch: list[tuple[str, str]] = [(f"--job-name={name}", "slurm.job_name"), (f"--nodes={nodes}", "slurm.nodes"),
                                     (f"--ntasks-per-node={total // nodes}", "num_processes")]
    if options.cpus_per_task:
        sbatch.append((f"--cpus-per-task={options.cpus_per_task}", "slurm.cpus_per_task"))
    if options.gpus_per_task:
        sbatch.append((f"--gpus-per-task={options.gpus_per_task}", "slurm.gpus_per_task"))
    for flag, value in (("time", options.time), ("partition", options.partition), ("account", options.account)):
        if value:
            sbatch.append((f"--{flag}={value}", f"slurm.{flag}"))
    sbatch.append((f"--output={output}", "slurm.output" if options.output else "--log_dir"))
    if "SIGUSR1" in signals:  # to every task of the steps (not B:, the batch shell, which would die of it)
        sbatch.append((f"--signal=USR1@{options.signal_seconds}", "slurm.signal_seconds"))
    if requeue:  # the requeued job appends to the same output file
        sbatch += [("--requeue", "preemption.requeue"), ("--open-mode=append", "preemption.requeue")]
    sbatch += [(arg, "slurm.sbatch_args") for arg in options.sbatch_args]
    lines = ["#!/bin/bash", *(f"#SBATCH {sbatch_quote(option, what)}" for option, what in sbatch)]
    lines += ["", "# written by torchrig launch --cluster slurm; each srun task is one rank (the slurm plugin reads",
              "# SLURM_PROCID, SLURM_NTASKS, ...). The submitting shell's environment is exported by sbatch.",
              "set -eo pipefail", f"cd {shlex.quote(os.getcwd())}"]
    lines += [f"export {_env_name(key)}={shlex.quote(value)}" for key, value in sorted(plan.env.items())]
    srun = srun_command(total // nodes, nodes, plan.script_command,
                        cpus_per_task=options.cpus_per_task, extra=options.srun_args)
    lines += ["", f"exec {shlex.join(srun)}", ""]
    return "\n".join(lines)


def _env_name(key: str) -> str:
    if not _ENV_NAME.fullmatch(key):
        raise HandoffRefused(f"the worker environment variable name {key!r} is not a shell variable name "
                             "(letters, digits and '_', not starting with a digit)")
    return key


def describe_slurm(plan: LaunchPlan, srun: Sequence[str] | None) -> str:
    """``--dry-run``: the ``srun`` line (inside an allocation) or the batch script (outside), both
    exactly as they run: the script verbatim, the line shell-quoted (pasting it runs the same argv)."""
    if srun is not None:
        return f"  inside Slurm job: `{PROG}` runs one srun step over the allocation:\n  {shlex.join(srun)}"
    return (f"  Slurm: `{PROG}` would write this batch script to {os.path.join(plan.log_dir or '.', 'sbatch.sh')} "
            f"and submit it with sbatch (verbatim, to the end of this output):\n{sbatch_script(plan)}")


class SlurmLauncher(SlurmCluster):
    """The slurm plugin: detection (inherited) and the hand-off to ``srun`` / ``sbatch``."""

    @hookimpl
    def torchrig_launch(self, plan: LaunchPlan) -> int | None:
        """Hand off to Slurm where :func:`slurm_launch_mode` says so; else torch elastic starts the workers."""
        mode = slurm_launch_mode(plan, os.environ)
        if mode is None:
            return None
        try:
            if mode == "srun":
                return run_forwarding(plan, allocation_srun(plan, os.environ), what="srun")
            return submit(plan)
        except HandoffRefused as exc:
            return refuse(plan, "srun" if mode == "srun" else "sbatch", exc)

    @hookimpl
    def torchrig_describe_launch(self, plan: LaunchPlan) -> str | None:
        mode = slurm_launch_mode(plan, os.environ)
        if mode is None:
            return None
        return describe_slurm(plan, allocation_srun(plan, os.environ) if mode == "srun" else None)


#: How long ``sbatch`` may take to answer (it only talks to slurmctld).
SBATCH_TIMEOUT_S = 120


def submit(plan: LaunchPlan) -> int:
    """Write the batch script into the log directory and ``sbatch`` it; print the job id and how to
    follow it. When sbatch fails (a bad partition, a rejected job), its exit code and stderr are the
    diagnosis: printed and recorded in ``run_status.json``."""
    script = sbatch_script(plan)
    log_dir = plan.log_dir or os.getcwd()
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, "sbatch.sh")
    with open(path, "w") as handle:
        handle.write(script)
    sbatch = shutil.which("sbatch")
    command = [sbatch or "sbatch", "--parsable", path]
    if sbatch is None:
        return sbatch_failed(plan, command, None, f"sbatch is not on PATH: run `{PROG} --cluster slurm` where "
                             f"Slurm's commands are (a login node), or submit the script it wrote yourself: "
                             f"sbatch {shlex.quote(path)}")
    try:
        proc = subprocess.run(command, env={**os.environ, **plan.env}, capture_output=True, text=True,
                              timeout=SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return sbatch_failed(plan, command, None, f"sbatch did not answer in {SBATCH_TIMEOUT_S} s (is slurmctld "
                             f"reachable? `scontrol ping`); the job may or may not have been submitted: check "
                             "`squeue --me`")
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip() or "(no output)"
        return sbatch_failed(plan, command, proc.returncode,
                             f"sbatch rejected the job (exit {proc.returncode}): {said}", stderr=said)
    job = proc.stdout.strip().split(";")[0]
    record_handoff(plan, command, "sbatch", state=SUBMITTED, exit_code=0, headline=f"submitted Slurm job {job}")
    output = sbatch_output(plan)
    print(f"{PROG}: submitted Slurm job {job} (script {path})", flush=True)
    print(f"{PROG}: follow it with `squeue -j {job}` and `tail -f {shlex.quote(output_file(output, job))}`; "
          f"cancel it with `scancel {job}`", flush=True)
    return 0


def sbatch_failed(plan: LaunchPlan, command: Sequence[str], exit_code: int | None, message: str, *,
                  stderr: str | None = None) -> int:
    """Nothing was submitted: the reason printed and recorded (``reason: "sbatch_failed"``, sbatch's
    exit code and stderr in ``handoff``); ``torchrig launch`` exits 1."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
    record_handoff(plan, command, "sbatch", state=FAILED, exit_code=1, reason="sbatch_failed", headline=message,
                   detail={"exit_code": exit_code, "stderr": stderr})
    return 1


__all__ = [
    "SBATCH_TIMEOUT_S",
    "SLURM_INTERACTIVE_JOB_NAMES",
    "SLURM_MAX_NORMAL_STEP_ID",
    "SLURM_PORT_BASE",
    "SLURM_PORT_SPAN",
    "SUBMITTED",
    "SlurmCluster",
    "SlurmLauncher",
    "allocation_srun",
    "default_output",
    "derived_job_name",
    "describe_slurm",
    "detect_slurm",
    "output_file",
    "sbatch_failed",
    "sbatch_output",
    "sbatch_quote",
    "sbatch_script",
    "slurm_launch_mode",
    "slurm_master_port",
    "slurm_task_recognised",
    "srun_command",
    "submit",
]
