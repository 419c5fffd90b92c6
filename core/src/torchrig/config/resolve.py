"""Resolving one typed configuration from five sources, remembering where each value came from.

Precedence, lowest to highest (see docs/configuration.md for why):

1. built-in defaults;
2. the machine's default config file (written by ``torchrig config``) — it describes the machine;
3. ``Accelerator(...)`` arguments — the script's explicit choices beat the machine's defaults;
4. the config file named for this run (``--config_file`` / ``TORCHRIG_CONFIG_FILE``);
5. ``TORCHRIG_*`` environment variables;
6. ``torchrig launch`` flags (passed to workers in ``TORCHRIG_LAUNCH_OVERRIDES``).

Only keys present in a source count. When a higher source overrides a value the script passed
explicitly, a :class:`ConfigOverrideWarning` names both (an error with ``strict_config``).
Every problem found — unknown keys (with did-you-mean), wrong types or values (with dotted path
and file:line), plugin validation — is reported together in one :class:`~torchrig.errors.ConfigError`.

Torch-free: the launcher validates before starting anything, and every worker re-validates
with the script's arguments merged, with the same messages.

This module orders the steps; each lives in its own: :mod:`~torchrig.config.readers` (each source
into entries), :mod:`~torchrig.config.merge` (layering, coercion, options objects) and
:mod:`~torchrig.config.cross_checks` (checks between keys and the selected plugins' checks).
"""

from __future__ import annotations

import os
import pathlib
import warnings
from collections.abc import Mapping
from typing import Any

import attrs

from torchrig.config.cross_checks import (
    cross_section_problems,
    declared_axes,
    declared_tp_styles,
    plugin_validation_problems,
)
from torchrig.config.merge import (
    build_options_objects,
    choose_default_strategy,
    coerce_all,
    defaults_layer,
    merge_layers,
    resolve_plugin_names,
    section_defaults,
)
from torchrig.config.parallelism import parallelism_problems
from torchrig.config.readers import (
    CONFIG_FILE_ENV,
    CONFIG_HOME_ENV,
    LAUNCH_OVERRIDES_ENV,
    SourceReader,
    argument_entries,
    env_entries,
    file_entries,
    flag_entries,
    launch_overrides,
    location_of,
)
from torchrig.config.resolved import DeferredSections, ResolvedConfig, lazy_tables
from torchrig.config.schema import Problem
from torchrig.config.sections import Schema
from torchrig.config.sources import Entry, Layer, Note, Source
from torchrig.errors import ConfigError
from torchrig.host.plugin_host import PluginHost

DEFAULT_FILE_NAME = "default_config.yaml"


class ConfigOverrideWarning(UserWarning):
    """A config file, environment variable or flag overrode an explicit ``Accelerator(...)`` argument."""


def default_config_path(environ: Mapping[str, str] | None = None) -> pathlib.Path:
    """The machine's default config file: ``$TORCHRIG_CONFIG_HOME/default_config.yaml``, else
    ``~/.cache/torchrig/default_config.yaml``."""
    environ = os.environ if environ is None else environ
    home = environ.get(CONFIG_HOME_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "torchrig")
    return pathlib.Path(home) / DEFAULT_FILE_NAME


#: How a value read from Accelerate's default file is attributed (``torchrig config show``, ``--dry-run``).
ACCELERATE_DEFAULT_LABEL = "accelerate default config"


def accelerate_default_config_path(environ: Mapping[str, str] | None = None) -> pathlib.Path:
    """Accelerate's default config file, by Accelerate 1.15's rule: ``$HF_HOME/accelerate/default_config.yaml``,
    else ``$XDG_CACHE_HOME/huggingface/...``, else ``~/.cache/huggingface/accelerate/default_config.yaml``."""
    environ = os.environ if environ is None else environ
    hf_home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return pathlib.Path(os.path.expanduser(hf_home)) / "accelerate" / DEFAULT_FILE_NAME


def machine_default_file(environ: Mapping[str, str] | None = None) -> tuple[pathlib.Path, str | None] | None:
    """The machine's default file in use and how its values are attributed: torchrig's own
    (:func:`default_config_path`); when there is none, Accelerate's (``accelerate config`` wrote it:
    a user coming from Accelerate keeps their machine's settings), labelled as such; else None."""
    own = default_config_path(environ)
    if own.is_file():
        return own, None
    accelerate = accelerate_default_config_path(environ)
    return (accelerate, ACCELERATE_DEFAULT_LABEL) if accelerate.is_file() else None


# --------------------------------------------------------------------------------------------
# resolution


def resolve_config(
    host: PluginHost,
    *,
    arguments: Mapping[str, Any] | None = None,
    config_file: str | os.PathLike | None = None,
    flags: Mapping[str, tuple[Any, str]] | None = None,
    environ: Mapping[str, str] | None = None,
    default_file: str | os.PathLike | None | bool = True,
    world_size: int | None = None,
    warn: bool = True,
) -> ResolvedConfig:
    """Resolve the run's configuration. Raises :class:`ConfigError` listing every problem.

    ``arguments``: the script's ``Accelerator(...)`` arguments (config keys, section keys or
    options objects). ``config_file``: the run's file (else ``TORCHRIG_CONFIG_FILE``).
    ``flags``: ``{key: (value, "--flag")}`` (else ``TORCHRIG_LAUNCH_OVERRIDES``). ``default_file``:
    ``True`` for the machine's default file (torchrig's, else Accelerate's: :func:`machine_default_file`),
    a path, or ``False``/``None`` for none.
    ``world_size``: the detected number of processes (picks the default strategy).
    """
    environ = dict(os.environ if environ is None else environ)
    schema = Schema(host)
    problems: list[Problem] = list(schema.problems)
    notes: list[Note] = []
    reader = SourceReader(schema, problems, notes)

    layers: list[dict[str, Entry]] = []
    default_label = None
    if default_file is True:
        found = machine_default_file(environ)
        default_file, default_label = found if found else (None, None)
    layers.append(_guarded(problems, lambda: file_entries(reader, default_file, Layer.DEFAULT_FILE, default_label))
                  if default_file else {})
    layers.append(argument_entries(reader, arguments or {}))
    run_file = config_file or environ.get(CONFIG_FILE_ENV)
    layers.append(_guarded(problems, lambda: file_entries(reader, run_file, Layer.CONFIG_FILE)) if run_file else {})
    layers.append(env_entries(schema, environ, problems))
    flag_values = flags if flags is not None else _guarded_flags(problems, environ)
    layers.append(flag_entries(schema, flag_values, problems))
    # A section no source touched whose class is not imported yet is left to be built on first
    # use (sections.py): the defaults of the others come first, as the lowest layer.
    touched = {key.rpartition(".")[0] for layer in layers for key in layer}
    deferred = [key for key in schema.sections if key not in touched and schema.is_deferred(key)]
    built = [key for key in schema.sections if key not in deferred]
    layers.insert(0, defaults_layer(schema, built))

    winners, override_messages = merge_layers(schema, layers)
    values = coerce_all(schema, winners, problems)
    resolve_plugin_names(schema, values, winners, problems)
    core, sections = build_options_objects(schema, values, winners, problems, built)
    choose_default_strategy(schema, values, winners, world_size, problems)
    cross_section_problems(values, winners, problems)
    problems += parallelism_problems(values, lambda key: location_of(winners[key].source) if key in winners else None,
                                     world_size=world_size or values.get("num_processes"),
                                     strategy=values.get("strategy"), declared_axes=declared_axes(schema),
                                     declared_tp_styles=declared_tp_styles(schema))

    strict = bool(values.get("strict_config"))
    if strict:
        problems.extend(Problem(key, message + " (strict_config is on)") for key, message in override_messages)
    if problems:
        raise ConfigError([str(p) for p in _dedupe(problems)])
    assert core is not None
    core = attrs.evolve(core, strategy=values["strategy"])
    tables = lazy_tables(values, {key: entry.source for key, entry in winners.items()}, sections,
                         DeferredSections(deferred, lambda key: _build_deferred(schema, key), schema.all_keys))
    resolved = ResolvedConfig(
        values=tables[0],
        sources=tables[1],
        core=core,
        sections=tables[2],
        notes=tuple(notes),
        warnings=tuple(message for _, message in override_messages),
        declared=schema.sections,
    )
    plugin_problems = plugin_validation_problems(host, resolved)
    if plugin_problems:
        raise ConfigError(plugin_problems)
    if warn:
        for message in resolved.warnings:
            warnings.warn(message, ConfigOverrideWarning, stacklevel=3)
    return resolved


def _guarded(problems: list[Problem], read: Any) -> dict[str, Entry]:
    try:
        return read()
    except ConfigError as exc:
        problems.extend(Problem("file", p) for p in exc.problems)
        return {}


def _guarded_flags(problems: list[Problem], environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    try:
        return launch_overrides(environ)
    except ConfigError as exc:
        problems.extend(Problem(LAUNCH_OVERRIDES_ENV, p) for p in exc.problems)
        return {}


def _build_deferred(schema: Schema, key: str) -> tuple[dict[str, Any], dict[str, Source], Any]:
    """A deferred section, built when first read: its defaults, through the same coercion and
    construction as every other section (a problem there is the plugin's: its defaults are bad)."""
    entries = section_defaults(schema, key, Source(Layer.DEFAULT))
    problems: list[Problem] = []
    values = coerce_all(schema, entries, problems)
    resolve_plugin_names(schema, values, entries, problems)
    _, sections = build_options_objects(schema, values, entries, problems, [key], core=False)
    if problems:
        raise ConfigError([str(p) for p in _dedupe(problems)])
    return values, {k: entry.source for k, entry in entries.items()}, sections[key]



def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen: set[str] = set()
    out = []
    for problem in problems:
        text = str(problem)
        if text not in seen:
            seen.add(text)
            out.append(problem)
    return out


__all__ = [
    "ACCELERATE_DEFAULT_LABEL",
    "ConfigOverrideWarning",
    "Entry",
    "Layer",
    "Note",
    "ResolvedConfig",
    "Schema",
    "Source",
    "accelerate_default_config_path",
    "default_config_path",
    "machine_default_file",
    "resolve_config",
]