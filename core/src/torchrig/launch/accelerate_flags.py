"""``accelerate launch``'s flags on ``torchrig launch``: every one is accepted, in both spellings.

What each does is declared once, in :data:`torchrig.config.compat.ACCELERATE_LAUNCH_FLAGS`; this
module adds the flags the core and the installed plugins do not already define to the launcher's
parser, and turns the ones given into configuration (the flag layer), launcher settings
(``OMP_NUM_THREADS``, rendezvous options), notes (no effect, and why) or one error listing every
refusal with its reason.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, MutableMapping
from typing import Any

import attrs

from torchrig.config import compat
from torchrig.config.resolve import Schema
from torchrig.errors import ConfigError

_DEST_PREFIX = "_accelerate_flag_"


@attrs.define
class AppliedFlags:
    """What the launcher does with the Accelerate flags given (beyond the configuration)."""

    #: One line each: ``--flag has no effect: why``.
    notes: list[str] = attrs.field(factory=list)
    #: ``--num_cpu_threads_per_process``: every rank's ``OMP_NUM_THREADS``.
    omp_num_threads: int | None = None
    #: ``--rdzv_conf``: extra options of torch elastic's rendezvous.
    rdzv_configs: dict[str, str] = attrs.field(factory=dict)


def add_accelerate_flags(parser: argparse.ArgumentParser) -> dict[str, compat.AccelerateFlag]:
    """Add each Accelerate flag ``parser`` does not define yet (an installed plugin's own flag
    wins); returns ``dest -> entry`` for :func:`apply_accelerate_flags`."""
    known = {option for action in parser._actions for option in action.option_strings}
    group = parser.add_argument_group(
        "Accelerate's launch flags", "accepted as `accelerate launch` accepts them, with either spelling "
        "(docs/accelerate.md); its TPU, Megatron-LM, SageMaker and DeepSpeed-launcher flags are refused with the "
        "reason and not listed here")
    by_dest: dict[str, compat.AccelerateFlag] = {}
    for entry in compat.ACCELERATE_LAUNCH_FLAGS:
        if entry.flag in known:
            continue
        dest = _DEST_PREFIX + entry.flag[2:]
        by_dest[dest] = entry
        shown = _help(entry) if not _refused_when_given(entry) else argparse.SUPPRESS
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": shown}
        if entry.repeated:
            kwargs.update(action="append", metavar="VALUE")
        elif entry.takes_value:
            kwargs.update(metavar="VALUE")
        else:
            kwargs.update(action="store_const", const=entry.const)
        spellings = [entry.flag] + (["-q"] if entry.flag == "--quiet" else [])
        group.add_argument(*spellings, **kwargs)
    return by_dest


def accelerate_entries(parser: argparse.ArgumentParser) -> dict[str, compat.AccelerateFlag]:
    """``dest -> entry`` of the Accelerate flags :func:`add_accelerate_flags` added to ``parser``."""
    by_flag = {entry.flag: entry for entry in compat.ACCELERATE_LAUNCH_FLAGS}
    return {action.dest: by_flag["--" + action.dest[len(_DEST_PREFIX):]] for action in parser._actions
            if action.dest.startswith(_DEST_PREFIX)}


def _refused_when_given(entry: compat.AccelerateFlag) -> bool:
    """A flag that is refused whatever its value (a TPU, Megatron-LM flag): kept out of ``--help``."""
    if entry.status == "rejected":
        return True
    if entry.status == "key":
        key = compat.BY_KEY[str(entry.target)]
        return not (key.status == "no_effect" and key.accepts(entry.const if not entry.takes_value else "given"))
    return False


def _help(entry: compat.AccelerateFlag) -> str:
    if entry.status == "config":
        return f"sets {entry.target}" + (f" = {entry.const}" if not entry.takes_value else "")
    if entry.status == "key":
        return "no effect: " + compat.BY_KEY[str(entry.target)].note
    prefix = {"no_effect": "no effect: ", "rejected": "refused: ", "applied": ""}[entry.status]
    return prefix + entry.note


def apply_accelerate_flags(namespace: argparse.Namespace, by_dest: Mapping[str, compat.AccelerateFlag],
                           flags: MutableMapping[str, tuple[Any, str]], schema: Schema) -> AppliedFlags:
    """Turn the Accelerate flags given into configuration (added to ``flags``, the flag layer) and
    launcher settings. Raises :class:`ConfigError` listing every flag refused, with the reason."""
    applied = AppliedFlags()
    problems: list[str] = []
    # Flags that only give a default for their key come last, so that any other flag setting it wins.
    for dest, entry in sorted(by_dest.items(), key=lambda item: item[1].gives_way):
        if not hasattr(namespace, dest):
            continue
        value = getattr(namespace, dest)
        if entry.status == "config":
            problem = _set_config(entry, value, flags, schema)
        elif entry.status == "key":
            problem = _accelerate_key(entry, value, applied)
        elif entry.status == "no_effect":
            applied.notes.append(f"{entry.flag} has no effect: {entry.note}")
            problem = None
        elif entry.status == "rejected":
            if entry.accepts(value):
                applied.notes.append(f"{entry.flag} {value} has no effect: {entry.note}")
                problem = None
            else:
                problem = f"{entry.flag} {value} is not supported: {entry.note}"
        else:
            problem = _launcher_setting(entry, value, applied)
        if problem:
            problems.append(problem)
    if problems:
        raise ConfigError(problems)
    return applied


def _set_config(entry: compat.AccelerateFlag, value: Any, flags: MutableMapping[str, tuple[Any, str]],
                schema: Schema) -> str | None:
    target = str(entry.target)
    section = target.partition(".")[0] if "." in target else None
    if section is not None and section not in schema.section_index:
        # The plugin that reads this section is not installed (or is disabled).
        if entry.strategy is not None and "strategy" not in flags:
            flags["strategy"] = (entry.strategy, entry.flag)  # reported exactly as `--strategy` reports it
            return None
        hint = compat.BY_KEY[section].install_hint if section in compat.BY_KEY else None
        fix = f": pip install '{hint}'" if hint else ""
        return f"{entry.flag} sets {target}, read by a plugin that is not installed or is disabled{fix}"
    if section is not None and target.partition(".")[2] in schema.key_index(section):
        target = f"{section}.{schema.key_index(section)[target.partition('.')[2]]}"
    given = value if entry.takes_value else entry.const
    if entry.gives_way and target in flags:
        return None
    if target in flags and flags[target][0] != given:
        return f"{flags[target][1]} and {entry.flag} both set {target} ({flags[target][0]!r} vs {given!r}); give one"
    flags[target] = (given, entry.flag)
    return None


def _accelerate_key(entry: compat.AccelerateFlag, value: Any, applied: AppliedFlags) -> str | None:
    key = compat.BY_KEY[str(entry.target)]
    given = value if entry.takes_value else entry.const
    if key.status == "no_effect" and key.accepts(given):
        applied.notes.append(f"{entry.flag} has no effect: {key.note}")
        return None
    return f"{entry.flag}{'' if given is True else f' {given!r}'} is not supported: {key.note}"


def _launcher_setting(entry: compat.AccelerateFlag, value: Any, applied: AppliedFlags) -> str | None:
    if entry.flag == "--num_cpu_threads_per_process":
        try:
            threads = int(value)
        except ValueError:
            threads = 0
        if threads < 1:
            return f"{entry.flag} must be a whole number of threads, at least 1 (got {value!r})"
        applied.omp_num_threads = threads
        return None
    if entry.flag == "--rdzv_conf":
        for item in str(value).split(","):
            name, equals, setting = item.strip().partition("=")
            if not equals or not name.strip():
                return (f"{entry.flag} {value!r}: expected key=value pairs separated by commas "
                        "(join_timeout=900,read_timeout=60)")
            applied.rdzv_configs[name.strip()] = setting.strip()
        return None
    raise AssertionError(f"no launcher setting declared for {entry.flag}")  # a table entry without its code


def normalize_spelling(token: str, known: set[str]) -> str:
    """``--num-processes=2`` -> ``--num_processes=2`` when only the underscore spelling is defined
    (Accelerate accepts both for every flag)."""
    if not token.startswith("--"):
        return token
    name, equals, rest = token.partition("=")
    if name in known:
        return token
    underscored = "--" + name[2:].replace("-", "_")
    return underscored + equals + rest if underscored in known else token


__all__ = ["AppliedFlags", "accelerate_entries", "add_accelerate_flags", "apply_accelerate_flags", "normalize_spelling"]
