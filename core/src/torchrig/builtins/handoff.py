"""What handing ``torchrig launch`` over to a cluster's own launcher runs: the ``slurm`` and
``mpi`` configuration sections and the command lines (``srun`` inside an allocation, the
``sbatch`` script from outside one, ``mpirun``) — pure functions of the launch plan.

Running them and recording the outcome is the launch layer's (:mod:`torchrig.launch.handoff`,
whose plugin classes answer ``torchrig_launch`` and ``torchrig_describe_launch`` where the
environment or the ``cluster`` option asks for a hand-off, and decline otherwise, so torch
elastic starts the workers). What each launcher starts is the user's own command (:attr:`LaunchPlan.script_command`):
every process it starts is one rank, and the cluster plugin of that rank tells it where it sits.
Torch-free.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from torchrig.config.schema import at_least, between, option
from torchrig.types import LaunchPlan

PROG = "torchrig launch"
#: ``run_status.json``'s state after ``--cluster slurm`` submitted the job (Slurm runs it later).
SUBMITTED = "submitted"

# --------------------------------------------------------------------------------------------
# Options: the `slurm` and `mpi` configuration sections
# --------------------------------------------------------------------------------------------

_SLURM_TIME = re.compile(r"(\d+)(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|unlimited|infinite", re.IGNORECASE)


def _slurm_time(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not _SLURM_TIME.fullmatch(str(value)):
        raise ValueError(f"expected a Slurm time limit (MINUTES, HH:MM:SS, D-HH, D-HH:MM:SS or UNLIMITED); "
                         f"got {value!r}", attribute)


def _word(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not str(value).strip() or re.search(r"\s", str(value))):
        raise ValueError(f"expected one word without spaces; got {value!r}", attribute)


def _options_list(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    bad = [item for item in value if not isinstance(item, str) or not item.startswith("-") or "\n" in item]
    if bad:
        raise ValueError(f"expected command-line options, each starting with '-' (e.g. '--mem=64G'); got {bad!r}",
                         attribute)


def _as_list(value: Any) -> Any:
    """``"--mem=8G --qos=high"`` (a flag or variable) means two options."""
    return shlex.split(value) if isinstance(value, str) else value


@attrs.frozen(kw_only=True)
class SlurmOptions:
    """``torchrig launch --cluster slurm`` outside an allocation: the ``#SBATCH`` lines of the job it
    submits (``num_processes`` tasks over ``nodes``); inside one, the ``srun`` options."""

    nodes: int | None = option(None, help="nodes of the submitted job (default: num_machines); num_processes is "
                               "split evenly over them", validator=at_least(1))
    job_name: str | None = option(None, help="job name (default: torchrig-<script name>)", validator=_word)
    partition: str | None = option(None, help="partition (default: the cluster's default)", validator=_word)
    account: str | None = option(None, help="account charged for the job", validator=_word)
    time: str | None = option(None, help="time limit: MINUTES, HH:MM:SS, D-HH:MM:SS or UNLIMITED (default: the "
                              "partition's)", validator=_slurm_time)
    cpus_per_task: int | None = option(None, help="CPUs per task (default: Slurm's, 1)", validator=at_least(1))
    gpus_per_task: int | None = option(None, help="GPUs per task (default: none requested)", validator=at_least(1))
    signal_seconds: int = option(120, help="with preemption.signals SIGUSR1: Slurm sends SIGUSR1 to the tasks this "
                                 "many seconds before the time limit (--signal=USR1@N)", validator=between(1, 65535))
    output: str | None = option(None, help="the job's output file (default: <log_dir>/slurm-%j.out)")
    sbatch_args: list[str] = option(factory=list, help="more #SBATCH options, e.g. ['--mem=64G', '--qos=high']",
                                    converter=_as_list, normalize=_as_list, validator=_options_list)
    srun_args: list[str] = option(factory=list, help="more srun options, e.g. ['--mpi=pmi2']", converter=_as_list,
                                  normalize=_as_list, validator=_options_list)


@attrs.frozen(kw_only=True)
class MPIOptions:
    """``torchrig launch --cluster mpi``: where ``mpirun`` starts the ranks, and its extra options."""

    hosts: list[str] = option(factory=list, help="hosts as 'host' or 'host:slots' (default: this machine); the "
                              "first runs rank 0 and the rendezvous", converter=_as_list, normalize=_as_list)
    mpirun_args: list[str] = option(factory=list, help="more mpirun options, e.g. ['--oversubscribe']",
                                    converter=_as_list, normalize=_as_list, validator=_options_list)


# --------------------------------------------------------------------------------------------
# Command builders
# --------------------------------------------------------------------------------------------


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


def mpirun_command(
    nproc: int,
    command: Sequence[str],
    *,
    hosts: Sequence[str] | None = None,
    master_addr: str,
    master_port: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """The Open MPI ``mpirun`` command line that starts ``nproc`` training processes.

    ``mpirun -np N [-H host:slots,...] -x MASTER_ADDR=<addr> -x MASTER_PORT=<port> -x PATH
    *extra *command`` (Open MPI syntax: ``-H`` takes ``host:slots`` entries, ``-x NAME=VALUE``
    sets a variable in every rank and ``-x NAME`` forwards the launcher's own). ``hosts`` entries
    are ``"host"`` or ``"host:slots"``; bare hosts share ``nproc`` evenly (it must divide) and
    the slots must cover ``nproc``. ``master_addr`` must be the host of rank 0 (the first host),
    reachable from every other. ``command`` is the user's command
    (:attr:`LaunchPlan.script_command`). MPICH / Intel MPI spell it
    ``mpiexec -n N -hosts ... -genv MASTER_ADDR ...``; pass their lines yourself.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"mpirun_command: nproc must be a positive integer, not {nproc!r}")
    if isinstance(command, str) or not command:
        raise ValueError("mpirun_command: command must be a non-empty list of arguments")
    if not isinstance(master_addr, str) or not master_addr.strip():
        raise ValueError("mpirun_command: master_addr must be the host name or address of rank 0")
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not 1 <= master_port <= 65535:
        raise ValueError(f"mpirun_command: master_port must be a TCP port (1-65535), not {master_port!r}")
    args = ["mpirun", "-np", str(nproc)]
    if hosts:
        args += ["-H", ",".join(_host_slots(list(hosts), nproc))]
    args += ["-x", f"MASTER_ADDR={master_addr.strip()}", "-x", f"MASTER_PORT={master_port}", "-x", "PATH"]
    return [*args, *extra, *command]


def _host_slots(hosts: list[str], nproc: int) -> list[str]:
    bare = [h for h in hosts if ":" not in h]
    if bare and nproc % len(hosts):
        raise ValueError(f"mpirun_command: {nproc} processes do not divide evenly over {len(hosts)} hosts; "
                         "give each host its slots as 'host:slots'")
    entries, total = [], 0
    for host in hosts:
        name, sep, slots_text = host.partition(":")
        if not name.strip():
            raise ValueError(f"mpirun_command: empty host name in {host!r}")
        if sep:
            try:
                slots = int(slots_text)
            except ValueError:
                raise ValueError(f"mpirun_command: bad slot count in {host!r} (expected host:slots)") from None
            if slots < 1:
                raise ValueError(f"mpirun_command: bad slot count in {host!r} (expected host:slots)")
        else:
            slots = nproc // len(hosts)
        entries.append(f"{name.strip()}:{slots}")
        total += slots
    if total < nproc:
        raise ValueError(f"mpirun_command: the hosts offer {total} slots for {nproc} processes")
    return entries


# --------------------------------------------------------------------------------------------
# Slurm
# --------------------------------------------------------------------------------------------


def _section(plan: LaunchPlan, options: type) -> Any:
    return plan.config.section_of(options) if plan.config is not None else options()


def _is_set(plan: LaunchPlan, key: str) -> bool:
    return plan.config is not None and plan.config.is_set(key)


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
    options = _section(plan, SlurmOptions)
    nodes = plan.num_nodes if _is_set(plan, "num_machines") else (
        _positive_var(environ, "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1)
    if _is_set(plan, "num_processes"):
        total = plan.nproc_per_node * plan.num_nodes
    else:
        total = _positive_var(environ, "SLURM_NTASKS", "SLURM_NPROCS") or plan.nproc_per_node * nodes
    if total % nodes:
        raise ValueError(f"slurm: {total} processes do not divide over the allocation's {nodes} nodes; set "
                         "num_processes (--num_processes) to a multiple of the nodes")
    cpus = options.cpus_per_task or _positive_var(environ, "SLURM_CPUS_PER_TASK")
    return srun_command(total // nodes, nodes, plan.script_command, cpus_per_task=cpus, extra=options.srun_args)


def sbatch_script(plan: LaunchPlan) -> str:
    """The batch script ``torchrig launch --cluster slurm`` submits: ``#SBATCH`` lines from the
    ``slurm`` section, ``num_machines`` and ``num_processes`` (and the ``preemption`` section:
    ``--signal=USR1@N``, ``--requeue``), the environment the workers need, and one ``srun`` step."""
    options = _section(plan, SlurmOptions)
    config = plan.config
    signals = list(config.get("preemption.signals") or []) if config is not None else []
    requeue = bool(config.get("preemption.requeue")) if config is not None else False
    target = next((part for part in plan.script_command if not part.startswith("-") and part != sys.executable),
                  "job")
    name = options.job_name or f"torchrig-{os.path.splitext(os.path.basename(target))[0] or 'job'}"
    output = options.output or os.path.join(plan.log_dir or os.getcwd(), "slurm-%j.out")
    nodes, total = options.nodes or plan.num_nodes, plan.nproc_per_node * plan.num_nodes
    if total % nodes:
        raise ValueError(f"slurm: num_processes {total} does not divide over slurm.nodes {nodes}: each node runs "
                         "num_processes / nodes tasks")
    lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --nodes={nodes}",
             f"#SBATCH --ntasks-per-node={total // nodes}"]
    if options.cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={options.cpus_per_task}")
    if options.gpus_per_task:
        lines.append(f"#SBATCH --gpus-per-task={options.gpus_per_task}")
    for flag, value in (("time", options.time), ("partition", options.partition), ("account", options.account)):
        if value:
            lines.append(f"#SBATCH --{flag}={value}")
    lines.append(f"#SBATCH --output={output}")
    if "SIGUSR1" in signals:  # to every task of the steps (not B:, the batch shell, which would die of it)
        lines.append(f"#SBATCH --signal=USR1@{options.signal_seconds}")
    if requeue:  # the requeued job appends to the same output file
        lines += ["#SBATCH --requeue", "#SBATCH --open-mode=append"]
    lines += [f"#SBATCH {arg}" for arg in options.sbatch_args]
    lines += ["", "# written by torchrig launch --cluster slurm; each srun task is one rank (the slurm plugin reads",
              "# SLURM_PROCID, SLURM_NTASKS, ...). The submitting shell's environment is exported by sbatch.",
              "set -eo pipefail", f"cd {shlex.quote(os.getcwd())}"]
    lines += [f"export {key}={shlex.quote(value)}" for key, value in sorted(plan.env.items())]
    srun = srun_command(total // nodes, nodes, plan.script_command,
                        cpus_per_task=options.cpus_per_task, extra=options.srun_args)
    lines += ["", f"exec {shlex.join(srun)}", ""]
    return "\n".join(lines)


def describe_slurm(plan: LaunchPlan, srun: Sequence[str] | None) -> str:
    """``--dry-run``: the ``srun`` line (inside an allocation) or the batch script (outside)."""
    if srun is not None:
        return f"inside Slurm job: `{PROG}` runs one srun step over the allocation:\n  {shlex.join(srun)}"
    return (f"Slurm: `{PROG}` would write this batch script to {os.path.join(plan.log_dir or '.', 'sbatch.sh')} "
            f"and submit it with sbatch:\n{sbatch_script(plan)}")


# --------------------------------------------------------------------------------------------
# MPI
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def mpirun_line(plan: LaunchPlan, *, port: int | None = None) -> list[str]:
    """``mpirun`` for every rank of the plan: ``num_processes`` ranks on ``mpi.hosts`` (default:
    here), rendezvous on the first host (``main_process_ip``/``main_process_port`` when set),
    and the variables ``torchrig launch`` hands its workers forwarded with ``-x``."""
    options = _section(plan, MPIOptions)
    hosts = list(options.hosts)
    first = hosts[0].partition(":")[0] if hosts else "127.0.0.1"
    addr = plan.master_addr or first
    endpoint_port = int(plan.rdzv_endpoint.rpartition(":")[2] or 0)
    master_port = port or endpoint_port or _free_port()
    forwarded = [arg for key in sorted(plan.env) for arg in ("-x", key)]
    return mpirun_command(plan.nproc_per_node * plan.num_nodes, plan.script_command, hosts=hosts or None,
                          master_addr=addr, master_port=master_port, extra=[*forwarded, *options.mpirun_args])


def describe_mpi(plan: LaunchPlan) -> str:
    """``--dry-run``: the ``mpirun`` line (its port is picked again at launch unless ``main_process_port`` is set)."""
    return f"MPI: `{PROG}` would start every rank with mpirun:\n  {shlex.join(mpirun_line(plan))}"


__all__ = ["PROG", "SUBMITTED", "MPIOptions", "SlurmOptions", "allocation_srun", "describe_mpi", "describe_slurm",
           "mpirun_command", "mpirun_line", "sbatch_script", "srun_command"]
