"""Reading each configuration source — files (with ``extends:``), ``Accelerator(...)`` arguments,
``TORCHRIG_*`` environment variables, launch flags — into ``{dotted key: Entry}``.

Separate from :mod:`torchrig.config.resolve` because reading a source is about its spelling
(Accelerate's keys, env-var names, file:line marks) and knows nothing of precedence: every
source becomes the same shape of entries, and unknown keys become problems, here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import attrs

from torchrig.config import compat
from torchrig.config.loader import Document, resolve_extends
from torchrig.config.schema import Problem, suggest
from torchrig.config.sections import Schema
from torchrig.config.sources import Entry, Layer, Note, Source
from torchrig.errors import ConfigError

#: Environment variables with a meaning of their own, not configuration keys.
CONFIG_FILE_ENV = "TORCHRIG_CONFIG_FILE"
CONFIG_HOME_ENV = "TORCHRIG_CONFIG_HOME"
LAUNCH_OVERRIDES_ENV = "TORCHRIG_LAUNCH_OVERRIDES"
RESERVED_ENV = frozenset({CONFIG_FILE_ENV, CONFIG_HOME_ENV, LAUNCH_OVERRIDES_ENV, "TORCHRIG_LOG_LEVEL"})
ENV_PREFIX = "TORCHRIG_"


def env_name(key: str) -> str:
    """``fsdp_config.sharding_strategy`` -> ``TORCHRIG_FSDP_CONFIG__SHARDING_STRATEGY``."""
    return ENV_PREFIX + key.upper().replace(".", "__")



def _expand_options_object(value: Any, section: str) -> dict[str, Any]:
    """An options object passed as an argument sets all of its fields (the user built it)."""
    return {f.name: getattr(value, f.name) for f in attrs.fields(type(value))}


class SourceReader:
    """Turns one source's nested mapping into ``{dotted key: Entry}``, collecting problems."""

    def __init__(self, schema: Schema, problems: list[Problem], notes: list[Note]) -> None:
        self.schema, self.problems, self.notes = schema, problems, notes

    def read(
        self, data: Mapping[str, Any], source_of: Any, raw_of: Any = lambda path: None
    ) -> dict[str, Entry]:
        entries: dict[str, Entry] = {}
        strategy_spelling: dict[str, Any] = {}
        for key, value in data.items():
            path = (key,)
            if key in self.schema.root_index:
                name = self.schema.root_index[key]
                if name == "strategy":
                    strategy_spelling[key] = value
                entries[name] = Entry(value, source_of(path, key), raw_of(path))
            elif key in self.schema.section_index:
                self._read_section(self.schema.section_index[key], key, value, entries, source_of, raw_of)
            elif key == "dynamo_backend":  # older Accelerate files: top-level, not in dynamo_config
                entries["dynamo_config.backend"] = Entry(value, source_of(path, key), raw_of(path))
            elif key in compat.BY_KEY:
                self._accelerate_key(compat.BY_KEY[key], value, source_of(path, key))
            else:
                hint = suggest(key, self.schema.top_level_spellings())
                self.problems.append(Problem(key, f"unknown key{hint}", location_of(source_of(path, key))))
        if len(strategy_spelling) > 1:
            self._check_same_strategy(strategy_spelling, source_of)
        return entries

    def _read_section(self, section: str, spelled: str, value: Any, entries: dict[str, Entry], source_of: Any,
                      raw_of: Any) -> None:
        options_cls = self.schema.options(section)
        if value is None:
            return
        if isinstance(value, options_cls):
            value = _expand_options_object(value, section)
        if not isinstance(value, Mapping):
            self.problems.append(Problem(section, f"must be a mapping of {options_cls.__name__} options, got {value!r}",
                                         location_of(source_of((spelled,), spelled))))
            return
        index = self.schema.key_index(section)
        for sub, sub_value in value.items():
            path = (spelled, sub)
            if sub in index:
                entries[f"{section}.{index[sub]}"] = Entry(sub_value, source_of(path, f"{spelled}.{sub}"), raw_of(path))
            else:
                hint = suggest(str(sub), list(index))
                self.problems.append(Problem(f"{section}.{sub}", f"unknown key{hint}", location_of(source_of(path, sub))))

    def _accelerate_key(self, entry: compat.AccelerateKey, value: Any, source: Source) -> None:
        if entry.status == "supported":  # a plugin's section whose plugin is not installed
            if compat._off(value):
                self.notes.append(Note(entry.key, value, "empty section of a plugin that is not installed", source))
            else:
                hint = f": pip install '{entry.install_hint}'" if entry.install_hint else ""
                self.problems.append(Problem(entry.key, f"is read by a plugin that is not installed{hint}", location_of(source)))
        elif entry.status == "no_effect" and entry.accepts(value):
            self.notes.append(Note(entry.key, value, entry.note, source))
        elif entry.status == "rejected" and value is None:
            self.notes.append(Note(entry.key, value, entry.note, source))
        else:
            self.problems.append(Problem(entry.key, f"{value!r} is not supported: {entry.note}", location_of(source)))

    def _check_same_strategy(self, spellings: Mapping[str, Any], source_of: Any) -> None:
        lookup = self.schema.plugin_lookup("strategy")
        resolved = {lookup.get(str(v).lower(), str(v)) for v in spellings.values()}
        if len(resolved) > 1:
            given = ", ".join(f"{k}: {v}" for k, v in spellings.items())
            self.problems.append(Problem("strategy", f"two strategies at once ({given}); choose one",
                                         location_of(source_of((next(iter(spellings)),), "strategy"))))


def location_of(source: Source) -> str | None:
    return source.detail if source.layer in (Layer.DEFAULT_FILE, Layer.CONFIG_FILE) else str(source)


def file_entries(reader: SourceReader, path: str | os.PathLike, layer: Layer, label: str | None = None) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for document in resolve_extends(path):
        entries.update(_document_entries(reader, document, layer, label))
    return entries


def _document_entries(reader: SourceReader, document: Document, layer: Layer, label: str | None = None) -> dict[str, Entry]:
    return reader.read(
        document.data,
        source_of=lambda path, key: Source(layer, document.where(path), label),
        raw_of=lambda path: document.raw_scalars.get(path),
    )


def env_entries(schema: Schema, environ: Mapping[str, str], problems: list[Problem]) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    names: dict[str, str] | None = None  # every variable's key: built only to name a wrong one
    for var, value in sorted(environ.items()):
        if not var.startswith(ENV_PREFIX) or var in RESERVED_ENV:
            continue
        key = var[len(ENV_PREFIX):].lower().replace("__", ".")
        if not (schema.has_key(key) and env_name(key) == var and _settable_from_env(schema, key)):
            if names is None:
                names = {env_name(k): k for k in schema.all_keys() if _settable_from_env(schema, k)}
            if var not in names:
                problems.append(Problem(var, f"unknown torchrig environment variable{suggest(var, list(names))}", None))
                continue
            key = names[var]
        entries[key] = Entry(value, Source(Layer.ENV, var))
    return entries


def _settable_from_env(schema: Schema, key: str) -> bool:
    info = schema.spec(key).info
    return bool(info.env) and not info.python_only


def argument_entries(reader: SourceReader, arguments: Mapping[str, Any]) -> dict[str, Entry]:
    return reader.read(
        {k: v for k, v in arguments.items() if v is not None},
        source_of=lambda path, key: Source(Layer.ARGUMENT, f"Accelerator({path[0]}=...)"),
    )


def flag_entries(schema: Schema, flags: Mapping[str, tuple[Any, str]], problems: list[Problem]) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for key, (value, flag) in flags.items():
        if not schema.has_key(key):
            problems.append(Problem(key, f"flag {flag} sets an unknown key{suggest(key, sorted(schema.all_keys()))}", flag))
            continue
        entries[key] = Entry(value, Source(Layer.FLAG, flag))
    return entries


def launch_overrides(environ: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """The flag layer as ``torchrig launch`` hands it to its workers."""
    text = environ.get(LAUNCH_OVERRIDES_ENV)
    if not text:
        return {}
    try:
        data = json.loads(text)
        return {key: (item["value"], item["flag"]) for key, item in data.items()}
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"{LAUNCH_OVERRIDES_ENV} is not valid ({exc}); it is written by `torchrig launch`") from exc


def encode_launch_overrides(flags: Mapping[str, tuple[Any, str]]) -> str:
    return json.dumps({key: {"value": value, "flag": flag} for key, (value, flag) in flags.items()})
