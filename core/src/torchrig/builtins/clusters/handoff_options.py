"""The ``slurm`` and ``mpi`` configuration sections and the checks every hand-off value passes.

Apart from :mod:`.slurm` and :mod:`.mpi` because the manifests declare these sections, and the
manifests are loaded for ``torchrig --help`` and listing: this module sits low in the layers and
imports neither the launch layer nor torch. :class:`SlurmOptions` is the ``#SBATCH``/``srun``
options of ``torchrig launch --cluster slurm``; :class:`MPIOptions` where ``mpirun`` starts the ranks.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from typing import Any

import attrs

from torchrig.config.schema import CoercionError, at_least, between, option
from torchrig.plugin.types import LaunchPlan

_SLURM_TIME = re.compile(r"(\d+)(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|unlimited|infinite", re.IGNORECASE)

#: No generated line may carry these: a line break ends an ``#SBATCH`` line (what follows would be
#: a line of the script, which bash runs), and no other control character means anything in an option.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

#: A host of ``mpi.hosts`` (``host`` or ``host:slots``) or the rendezvous host: a name or an IPv4
#: address. Never a leading ``-`` (Open MPI hands the host to ``ssh``, which would read an option).
_HOST = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_HOST_SLOTS = re.compile(r"(?P<host>[^:]*)(?::(?P<slots>.*))?")


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


def plan_section(plan: LaunchPlan, options: type) -> Any:
    return plan.config.section_of(options) if plan.config is not None else options()


def plan_is_set(plan: LaunchPlan, key: str) -> bool:
    return plan.config is not None and plan.config.is_set(key)


__all__ = ["MPIOptions", "SlurmOptions", "control_character", "plan_is_set", "plan_section"]
