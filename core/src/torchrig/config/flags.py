"""Command-line flags for configuration keys: the core's top-level options plus the flags each
plugin contributes through ``torchrig_cli_flags``. Used by ``torchrig launch`` and
``torchrig config show/validate``; a flag is the highest-precedence source of its key.

Values are taken as text and coerced by the same code as files and environment variables, so
a bad flag value gets the same message as a bad file value.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from torchrig.config.resolve import Schema
from torchrig.config.schema import FieldSpec
from torchrig.errors import ConfigError


@attrs.frozen
class FlagSpec:
    flag: str
    key: str
    #: ``str``/``int``/``float``/``list`` take one value; ``bool`` takes an optional one;
    #: ``const`` takes none and stores ``const``.
    type: str = "str"
    const: Any = None
    help: str = ""
    owner: str = "the core"
    choices: tuple[str, ...] = ()
    metavar: str | None = None


def _type_of(spec: FieldSpec) -> str:
    text = repr(spec.type)
    if spec.type is bool or text in ("bool | None", "typing.Optional[bool]"):
        return "bool"
    if "list" in text:
        return "list"
    return "str"


def collect_flags(schema: Schema) -> list[FlagSpec]:
    """Every flag, in a stable order; two owners of one flag is a :class:`ConfigError`."""
    flags: list[FlagSpec] = []
    for name, spec in schema.root.items():
        if spec.info.python_only:
            continue
        spellings = [spec.info.flag or f"--{name}", *(f"--{alias}" for alias in spec.info.aliases)]
        for flag in spellings:
            flags.append(FlagSpec(flag, name, _type_of(spec), help=spec.info.help, choices=spec.info.choices))
    for section, specs in schema.section_fields.items():
        for name, spec in specs.items():
            if spec.info.flag:
                flags.append(FlagSpec(spec.info.flag, f"{section}.{name}", _type_of(spec), help=spec.info.help))
    for owner, call in schema.host.iter_impls("torchrig_cli_flags"):
        for cli_flag in call() or ():
            flags.append(FlagSpec(cli_flag.flag, cli_flag.key, cli_flag.type, cli_flag.const, cli_flag.help,
                                  owner.removesuffix("#manifest"), tuple(cli_flag.choices), cli_flag.metavar))
    seen: dict[str, FlagSpec] = {}
    clashes = []
    for spec in flags:
        if spec.flag in seen:
            clashes.append(f"{spec.flag} is contributed by both {seen[spec.flag].owner} and {spec.owner}")
        seen[spec.flag] = spec
    if clashes:
        raise ConfigError(clashes, header="conflicting command-line flags")
    return flags


def add_config_flags(parser: argparse.ArgumentParser, flags: Iterable[FlagSpec], title: str = "configuration") -> dict[str, FlagSpec]:
    """Add the flags to ``parser``; returns ``dest -> FlagSpec`` for :func:`flag_values`."""
    group = parser.add_argument_group(title)
    by_dest: dict[str, FlagSpec] = {}
    for index, spec in enumerate(flags):
        dest = f"_config_flag_{index}"
        by_dest[dest] = spec
        help_text = f"{spec.help} (one of: {', '.join(spec.choices)})" if spec.choices else spec.help
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": help_text}
        if spec.type == "const":
            kwargs.update(action="store_const", const=spec.const)
        elif spec.type == "bool":
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        else:
            kwargs.update(metavar=spec.metavar or spec.key.rpartition(".")[2].upper())
        group.add_argument(spec.flag, **kwargs)
    return by_dest


def flag_values(namespace: argparse.Namespace, by_dest: Mapping[str, FlagSpec]) -> dict[str, tuple[Any, str]]:
    """``{key: (value, flag)}`` of the flags given; two flags giving one key different values is
    a :class:`ConfigError` (``--use_fsdp --use_deepspeed``)."""
    values: dict[str, tuple[Any, str]] = {}
    problems = []
    for dest, spec in by_dest.items():
        if not hasattr(namespace, dest):
            continue
        value = getattr(namespace, dest)
        if spec.key in values and values[spec.key][0] != value:
            other = values[spec.key][1]
            problems.append(f"{other} and {spec.flag} both set {spec.key} ({values[spec.key][0]!r} vs {value!r}); give one")
            continue
        values[spec.key] = (value, spec.flag)
    if problems:
        raise ConfigError(problems)
    return values


__all__ = ["FlagSpec", "add_config_flags", "collect_flags", "flag_values"]
