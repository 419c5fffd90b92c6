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

from torchrig.config.schema import CoercionError, at_least, between, option
from torchrig.plugin.types import LaunchPlan

PROG = "torchrig launch"
#: ``run_status.json``'s state after ``--cluster slurm`` submitted the job (Slurm runs it later).
SUBMITTED = "submitted"

# --------------------------------------------------------------------------------------------
# Options: the `slurm` and `mpi` configuration sections
# --------------------------------------------------------------------------------------------

_SLURM_TIME = re.compile(r"(\d+)(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|unlimited|infinite", re.IGNORECASE)

#: No generated line may carry these: a line break ends an ``#SBATCH`` line (what follows would be
#: a line of the script, which bash runs), and no other control character means anything in an option.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

#: A host of ``mpi.hosts`` (``host`` or ``host:slots``) or the rendezvous host: a name or an IPv4
#: address. Never a leading ``-`` (Open MPI hands the host to ``ssh``, which would read an option).
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_HOST_SLOTS = re.compile(r"(?P<host>[^:]*)(?::(?P<slots>.*))?")
#: The rendezvous address may also be an IPv6 address (with a ``%zone``).
_ADDRESS = re.compile(r"[A-Za-z0-9_:\[][A-Za-z0-9_.:%\[\]-]*")


class HandoffRefused(ValueError):
    """A value that cannot reach the cluster's launcher safely; the message names it and what to do."""


def control_character(value: str) -> str | None:
    """How to name the first control character of ``value`` (``'a newline (\\n)'``), or ``None``."""
    match = _CONTROL.search(value)
    if match is None:
        return None
    char = match.group(0)
    names = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab", "\x00": "a NUL byte"}
    return f"{names.get(char, 'a control character')} ({char!r})"


def _slurm_time(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and not _SLURM_TIME.fullmatch(str(value)):
        raise ValueError(f"expected a Slurm time limit (MINUTES, HH:MM:SS, D-HH, D-HH:MM:SS or UNLIMITED); "
                         f"got {value!r}", attribute)


def _word(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is not None and (not str(value).strip() or re.search(r"\s", str(value)) or _CONTROL.search(str(value))):
        raise ValueError(f"expected one word without spaces or control characters; got {value!r}", attribute)


def _line_text(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """A value written into one line of the batch script: anything but a control character."""
    found = control_character(value) if isinstance(value, str) else None
    if found:
        raise ValueError(f"{value!r} contains {found}, which cannot be written into an #SBATCH line (it would "
                         "end the line and run the rest as a command); remove it", attribute)


def _option_entries(*, refused: Mapping[str, str] | None = None) -> Any:
    """Validator of ``*_args``: command-line options, each starting with ``-``, no control
    character; ``refused`` maps an option (or a prefix getopt would expand to it) to why not."""

    def check(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        bad = [item for item in value if not isinstance(item, str) or not item.startswith("-")]
        if bad:
            raise ValueError(f"expected command-line options, each starting with '-' (e.g. '--mem=64G'); got {bad!r}",
                             attribute)
        for item in value:
            found = control_character(item)
            if found:
                raise ValueError(f"the entry {item!r} contains {found}: a command-line option cannot carry one; "
                                 "remove it", attribute)
            name = item.split("=", 1)[0]
            for option_name, why in (refused or {}).items():
                if len(name) >= 4 and option_name.startswith(name):
                    raise ValueError(f"the entry {item!r} is {option_name}, which {why}", attribute)

    return check


def _as_list(value: Any) -> Any:
    """``"--mem=8G --qos=high"`` (a flag or variable) means two options, split as a shell would."""
    if not isinstance(value, str):
        return value
    try:
        return shlex.split(value)
    except ValueError as exc:  # "No closing quotation"
        raise CoercionError(f"expected options as a list, or one string split as a shell splits it; {value!r} "
                            f"cannot be split: {exc}") from None


def _host_list(value: Any) -> Any:
    """``"a,b:2"`` or ``"a b"`` (a file, flag or variable) means those hosts, as Open MPI's ``-H`` reads them."""
    return [part for part in re.split(r"[,\s]+", value) if part] if isinstance(value, str) else value


def _hosts(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    for entry in value:
        match = _HOST_SLOTS.fullmatch(entry)
        host, slots = (match.group("host"), match.group("slots")) if match else (entry, None)
        if not _HOST.fullmatch(host):
            raise ValueError(f"{entry!r} is not a host name (letters, digits, '.', '-', '_', not starting with '-'), "
                             "optionally followed by ':slots'", attribute)
        if slots is not None and not (slots.isdigit() and int(slots) >= 1):
            raise ValueError(f"bad slot count in {entry!r}: expected 'host:slots' with slots a positive integer",
                             attribute)


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
    output: str | None = option(None, help="the job's output file, Slurm's %-patterns allowed (default: "
                                "<log_dir>/slurm-%j.out)", validator=_line_text)
    sbatch_args: list[str] = option(factory=list, help="more #SBATCH options, e.g. ['--mem=64G', '--qos=high']",
                                    converter=_as_list, normalize=_as_list, validator=_option_entries(
                                        refused={"--wrap": "would replace the batch script torchrig writes; "
                                                 "run the command as the launched script instead"}))
    srun_args: list[str] = option(factory=list, help="more srun options, e.g. ['--mpi=pmi2']", converter=_as_list,
                                  normalize=_as_list, validator=_option_entries())


@attrs.frozen(kw_only=True)
class MPIOptions:
    """``torchrig launch --cluster mpi``: where ``mpirun`` starts the ranks, and its extra options."""

    hosts: list[str] = option(factory=list, help="hosts as 'host' or 'host:slots', a list or one string separated "
                              "by commas or spaces (default: this machine); the first runs rank 0 and the rendezvous",
                              converter=_host_list, normalize=_host_list, validator=_hosts)
    mpirun_args: list[str] = option(factory=list, help="more mpirun options, e.g. ['--oversubscribe']",
                                    converter=_as_list, normalize=_as_list, validator=_option_entries())


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
    return _section(plan, SlurmOptions).output or default_output(_log_dir(plan))


def sbatch_script(plan: LaunchPlan) -> str:
    """The batch script ``torchrig launch --cluster slurm`` submits: ``#SBATCH`` lines from the
    ``slurm`` section, ``num_machines`` and ``num_processes`` (and the ``preemption`` section:
    ``--signal=USR1@N``, ``--requeue``), the environment the workers need, and one ``srun`` step.

    Every value reaches sbatch or bash exactly: ``#SBATCH`` options through :func:`sbatch_quote`,
    the body's words through :func:`shlex.quote`; a value that cannot is refused
    (:class:`HandoffRefused`, naming it)."""
    options = _section(plan, SlurmOptions)
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
    main_ip = plan.config.get("main_process_ip") if plan.config is not None else None
    addr = plan.master_addr or main_ip or first
    if not _ADDRESS.fullmatch(addr) or addr.startswith("-"):
        raise HandoffRefused(f"main_process_ip = {addr!r} is not a host name or address: mpirun exports it to "
                             "every rank as MASTER_ADDR; give the name or address of the first host")
    endpoint_port = int(plan.rdzv_endpoint.rpartition(":")[2] or 0)
    master_port = port or endpoint_port or _free_port()
    forwarded = [arg for key in sorted(plan.env) for arg in ("-x", key)]
    nproc = plan.nproc_per_node * plan.num_nodes
    if hosts:
        try:
            _host_slots(hosts, nproc)
        except ValueError as exc:
            raise HandoffRefused(f"mpi.hosts {hosts!r} cannot hold num_processes {nproc}: "
                                 f"{str(exc).removeprefix('mpirun_command: ')}") from None
    return mpirun_command(nproc, plan.script_command, hosts=hosts or None, master_addr=addr, master_port=master_port,
                          extra=[*forwarded, *options.mpirun_args])


def describe_mpi(plan: LaunchPlan) -> str:
    """``--dry-run``: the ``mpirun`` line, shell-quoted, to the end of the output (pasting it runs the same
    argv; its port is picked again at launch unless ``main_process_port`` is set)."""
    port = "" if plan.rdzv_endpoint.rpartition(":")[2] not in ("", "0") else (
        " (MASTER_PORT is picked again at launch: set main_process_port to fix it)")
    return f"  MPI: `{PROG}` would start every rank with mpirun{port}:\n  {shlex.join(mpirun_line(plan))}"


__all__ = ["PROG", "SUBMITTED", "HandoffRefused", "MPIOptions", "SlurmOptions", "allocation_srun", "control_character",
           "default_output", "derived_job_name", "describe_mpi", "describe_slurm", "mpirun_command", "mpirun_line",
           "output_file", "sbatch_output", "sbatch_quote", "sbatch_script", "srun_command"]
