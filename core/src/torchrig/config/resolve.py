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
"""

from __future__ import annotations

import json
import os
import pathlib
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from torchrig.config import compat
from torchrig.config.loader import Document, resolve_extends
from torchrig.config.options import CoreOptions
from torchrig.config.parallelism import parallelism_problems
from torchrig.config.resolved import DeferredSections, ResolvedConfig, lazy_tables
from torchrig.config.schema import CoercionError, Problem, build_options, coerce, suggest
from torchrig.config.sections import Schema
from torchrig.config.sources import Entry, Layer, Note, Source
from torchrig.errors import ConfigError
from torchrig.plugin_host import PluginHost, PluginStatus
from torchrig.types import ConfigProblem

#: Environment variables with a meaning of their own, not configuration keys.
CONFIG_FILE_ENV = "TORCHRIG_CONFIG_FILE"
CONFIG_HOME_ENV = "TORCHRIG_CONFIG_HOME"
LAUNCH_OVERRIDES_ENV = "TORCHRIG_LAUNCH_OVERRIDES"
RESERVED_ENV = frozenset({CONFIG_FILE_ENV, CONFIG_HOME_ENV, LAUNCH_OVERRIDES_ENV, "TORCHRIG_LOG_LEVEL"})
ENV_PREFIX = "TORCHRIG_"
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


def env_name(key: str) -> str:
    """``fsdp_config.sharding_strategy`` -> ``TORCHRIG_FSDP_CONFIG__SHARDING_STRATEGY``."""
    return ENV_PREFIX + key.upper().replace(".", "__")


# --------------------------------------------------------------------------------------------
# reading each source into entries


def _expand_options_object(value: Any, section: str) -> dict[str, Any]:
    """An options object passed as an argument sets all of its fields (the user built it)."""
    return {f.name: getattr(value, f.name) for f in attrs.fields(type(value))}


class _Reader:
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
                self.problems.append(Problem(key, f"unknown key{hint}", _where(source_of(path, key))))
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
                                         _where(source_of((spelled,), spelled))))
            return
        index = self.schema.key_index(section)
        for sub, sub_value in value.items():
            path = (spelled, sub)
            if sub in index:
                entries[f"{section}.{index[sub]}"] = Entry(sub_value, source_of(path, f"{spelled}.{sub}"), raw_of(path))
            else:
                hint = suggest(str(sub), list(index))
                self.problems.append(Problem(f"{section}.{sub}", f"unknown key{hint}", _where(source_of(path, sub))))

    def _accelerate_key(self, entry: compat.AccelerateKey, value: Any, source: Source) -> None:
        if entry.status == "supported":  # a plugin's section whose plugin is not installed
            if compat._off(value):
                self.notes.append(Note(entry.key, value, "empty section of a plugin that is not installed", source))
            else:
                hint = f": pip install '{entry.install_hint}'" if entry.install_hint else ""
                self.problems.append(Problem(entry.key, f"is read by a plugin that is not installed{hint}", _where(source)))
        elif entry.status == "no_effect" and entry.accepts(value):
            self.notes.append(Note(entry.key, value, entry.note, source))
        elif entry.status == "rejected" and value is None:
            self.notes.append(Note(entry.key, value, entry.note, source))
        else:
            self.problems.append(Problem(entry.key, f"{value!r} is not supported: {entry.note}", _where(source)))

    def _check_same_strategy(self, spellings: Mapping[str, Any], source_of: Any) -> None:
        lookup = self.schema.plugin_lookup("strategy")
        resolved = {lookup.get(str(v).lower(), str(v)) for v in spellings.values()}
        if len(resolved) > 1:
            given = ", ".join(f"{k}: {v}" for k, v in spellings.items())
            self.problems.append(Problem("strategy", f"two strategies at once ({given}); choose one",
                                         _where(source_of((next(iter(spellings)),), "strategy"))))


def _where(source: Source) -> str | None:
    return source.detail if source.layer in (Layer.DEFAULT_FILE, Layer.CONFIG_FILE) else str(source)


def _file_entries(reader: _Reader, path: str | os.PathLike, layer: Layer, label: str | None = None) -> dict[str, Entry]:
    entries: dict[str, Entry] = {}
    for document in resolve_extends(path):
        entries.update(_document_entries(reader, document, layer, label))
    return entries


def _document_entries(reader: _Reader, document: Document, layer: Layer, label: str | None = None) -> dict[str, Entry]:
    return reader.read(
        document.data,
        source_of=lambda path, key: Source(layer, document.where(path), label),
        raw_of=lambda path: document.raw_scalars.get(path),
    )


def _env_entries(schema: Schema, environ: Mapping[str, str], problems: list[Problem]) -> dict[str, Entry]:
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


def _argument_entries(reader: _Reader, arguments: Mapping[str, Any]) -> dict[str, Entry]:
    return reader.read(
        {k: v for k, v in arguments.items() if v is not None},
        source_of=lambda path, key: Source(Layer.ARGUMENT, f"Accelerator({path[0]}=...)"),
    )


def _flag_entries(schema: Schema, flags: Mapping[str, tuple[Any, str]], problems: list[Problem]) -> dict[str, Entry]:
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
    reader = _Reader(schema, problems, notes)

    layers: list[dict[str, Entry]] = []
    default_label = None
    if default_file is True:
        found = machine_default_file(environ)
        default_file, default_label = found if found else (None, None)
    layers.append(_guarded(problems, lambda: _file_entries(reader, default_file, Layer.DEFAULT_FILE, default_label))
                  if default_file else {})
    layers.append(_argument_entries(reader, arguments or {}))
    run_file = config_file or environ.get(CONFIG_FILE_ENV)
    layers.append(_guarded(problems, lambda: _file_entries(reader, run_file, Layer.CONFIG_FILE)) if run_file else {})
    layers.append(_env_entries(schema, environ, problems))
    flag_values = flags if flags is not None else _guarded_flags(problems, environ)
    layers.append(_flag_entries(schema, flag_values, problems))
    # A section no source touched whose class is not imported yet is left to be built on first
    # use (sections.py): the defaults of the others come first, as the lowest layer.
    touched = {key.rpartition(".")[0] for layer in layers for key in layer}
    deferred = [key for key in schema.sections if key not in touched and schema.is_deferred(key)]
    built = [key for key in schema.sections if key not in deferred]
    layers.insert(0, _defaults(schema, built))

    winners, override_messages = _merge(schema, layers)
    values = _coerce_all(schema, winners, problems)
    _resolve_plugin_names(schema, values, winners, problems)
    core, sections = _build(schema, values, winners, problems, built)
    _choose_default_strategy(schema, values, winners, world_size, problems)
    _cross_checks(values, winners, problems)
    problems += parallelism_problems(values, lambda key: _where(winners[key].source) if key in winners else None,
                                     world_size=world_size or values.get("num_processes"),
                                     strategy=values.get("strategy"), declared_axes=_declared_axes(schema),
                                     declared_tp_styles=_declared_tp_styles(schema))

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
    plugin_problems = _plugin_validation(host, resolved)
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


def _defaults(schema: Schema, sections: Iterable[str]) -> dict[str, Entry]:
    """The lowest layer: the core's defaults and those of ``sections``."""
    source = Source(Layer.DEFAULT)
    entries = {name: Entry(spec.default(), source) for name, spec in schema.root.items()}
    for key in sections:
        entries.update(_section_defaults(schema, key, source))
    return entries


def _section_defaults(schema: Schema, key: str, source: Source) -> dict[str, Entry]:
    base = schema.sections[key].default
    return {f"{key}.{name}": Entry(getattr(base, name) if base is not None else (spec.default() if spec.has_default
                                                                                 else None), source)
            for name, spec in schema.fields(key).items()}


def _build_deferred(schema: Schema, key: str) -> tuple[dict[str, Any], dict[str, Source], Any]:
    """A deferred section, built when first read: its defaults, through the same coercion and
    construction as every other section (a problem there is the plugin's: its defaults are bad)."""
    entries = _section_defaults(schema, key, Source(Layer.DEFAULT))
    problems: list[Problem] = []
    values = _coerce_all(schema, entries, problems)
    _resolve_plugin_names(schema, values, entries, problems)
    _, sections = _build(schema, values, entries, problems, [key], core=False)
    if problems:
        raise ConfigError([str(p) for p in _dedupe(problems)])
    return values, {k: entry.source for k, entry in entries.items()}, sections[key]


def _merge(schema: Schema, layers: list[dict[str, Entry]]) -> tuple[dict[str, Entry], list[tuple[str, str]]]:
    winners: dict[str, Entry] = {}
    overrides: list[tuple[str, str]] = []
    for layer in layers:
        for key, entry in layer.items():
            previous = winners.get(key)
            if (
                previous is not None
                and previous.source.layer is Layer.ARGUMENT
                and entry.source.layer > Layer.ARGUMENT
                and not _same_value(schema, key, previous, entry)
            ):
                overrides.append(
                    (key, f"{key}: the script's {previous.source.detail} = {previous.value!r} is overridden by "
                          f"{entry.source} = {entry.value!r}")
                )
            winners[key] = entry
    return winners, overrides


def _coerced(schema: Schema, key: str, entry: Entry) -> Any:
    spec = schema.spec(key)
    value = spec.info.normalize(entry.value) if spec.info.normalize is not None else entry.value
    value = coerce(value, spec.type, entry.raw)
    kind = spec.info.choices_from_kind
    if kind is not None and isinstance(value, str):  # plugin names and aliases: DDP, MULTI_GPU, ddp
        value = schema.plugin_lookup(kind).get(value.lower(), value)
    return value


def _same_value(schema: Schema, key: str, a: Entry, b: Entry) -> bool:
    """Whether two sources give ``key`` the same value *as the run will see it*: ``--cpu`` (the
    text ``"true"``) and ``Accelerator(cpu=True)`` agree, so neither is an override."""
    if a.value == b.value:
        return True
    try:
        return bool(_coerced(schema, key, a) == _coerced(schema, key, b))
    except (CoercionError, TypeError, ValueError):  # a bad value is reported by _coerce_all
        return False


def _coerce_all(schema: Schema, winners: Mapping[str, Entry], problems: list[Problem]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, entry in winners.items():
        spec = schema.spec(key)
        value = entry.value
        if spec.info.python_only and entry.source.layer not in (Layer.DEFAULT, Layer.ARGUMENT):
            problems.append(Problem(key, "can only be set from Python (Accelerator arguments)", _where(entry.source)))
            continue
        try:
            if spec.info.normalize is not None:
                value = spec.info.normalize(value)
            value = coerce(value, spec.type, entry.raw)
        except CoercionError as exc:
            problems.append(Problem(key, str(exc), _where(entry.source)))
            continue
        if spec.info.choices and value is not None and value not in spec.info.choices:
            problems.append(Problem(key, f"must be one of {', '.join(spec.info.choices)}, got {value!r}"
                                         f"{suggest(str(value), spec.info.choices)}", _where(entry.source)))
            continue
        values[key] = value
    return values


def _resolve_plugin_names(schema: Schema, values: dict[str, Any], winners: Mapping[str, Entry],
                          problems: list[Problem]) -> None:
    """Plugin names (and aliases such as ``MULTI_GPU``) -> installed plugin names."""
    for key, spec in ((k, schema.spec(k)) for k in list(values)):
        kind = spec.info.choices_from_kind
        if kind is None or values[key] is None:
            continue
        lookup = schema.plugin_lookup(kind)
        given = values[key]
        items = given if isinstance(given, list) else [given]
        resolved = []
        for item in items:
            if not isinstance(item, str):  # e.g. a tracker object passed from Python
                resolved.append(item)
                continue
            if kind == "tracker" and item.lower() == "all":
                resolved.append("all")
                continue
            name = lookup.get(item.lower())
            if name is None:
                installed = sorted(set(lookup.values())) or ["none"]
                hint = compat.DISTRIBUTED_TYPE_HINTS.get(item.upper()) if kind == "strategy" else None
                fix = f"; install it with: pip install '{hint}'" if hint else ""
                problems.append(Problem(key, f"no {kind} plugin named {item!r}{suggest(item, sorted(lookup))}; "
                                             f"installed: {', '.join(installed)}{fix}", _where(winners[key].source)))
                continue
            resolved.append(name)
        values[key] = resolved if isinstance(given, list) else (resolved[0] if resolved else None)


def _build(schema: Schema, values: dict[str, Any], winners: Mapping[str, Entry], problems: list[Problem],
           section_keys: Iterable[str], *, core: bool = True) -> tuple[CoreOptions | None, dict[str, Any]]:
    def build(cls: type, prefix: str, names: Iterable[str]) -> Any:
        given = {name: values[f"{prefix}{name}"] for name in names if f"{prefix}{name}" in values}
        obj, found = build_options(cls, given, path=prefix.rstrip("."))
        for problem in found:
            entry = winners.get(problem.path)
            problem.where = _where(entry.source) if entry else None
        problems.extend(found)
        return obj

    built_core = build(CoreOptions, "", schema.root) if core else None
    sections = {key: build(schema.options(key), f"{key}.", schema.fields(key)) for key in section_keys}
    return built_core, sections


def _choose_default_strategy(schema: Schema, values: dict[str, Any], winners: dict[str, Entry],
                             world_size: int | None, problems: list[Problem]) -> None:
    if values.get("strategy") or winners["strategy"].source.layer is not Layer.DEFAULT:
        return  # chosen (or chosen wrongly, which is reported already)
    processes = max(world_size or 1, values.get("num_processes") or 1, values.get("num_machines") or 1)
    if processes <= 1:
        values["strategy"] = "single"
        return
    candidates = [i for i in schema.host.plugins("strategy")
                  if i.manifest is not None and i.manifest.default_for_distributed and i.status is not PluginStatus.DISABLED]
    if len(candidates) == 1:
        values["strategy"] = candidates[0].name
        winners["strategy"] = Entry(candidates[0].name, Source(Layer.DEFAULT, f"(the default for {processes} processes)"))
        return
    names = ", ".join(i.key for i in candidates)
    problems.append(Problem("strategy", (
        f"{processes} processes but no strategy was chosen and "
        + (f"several strategies claim to be the default ({names})" if candidates else "no data-parallel strategy is installed")
        + "; set strategy (--strategy NAME / distributed_type)")))


def _cross_checks(values: Mapping[str, Any], winners: Mapping[str, Entry], problems: list[Problem]) -> None:
    def where(key: str) -> str | None:
        return _where(winners[key].source) if key in winners else None

    if not all(isinstance(values.get(k), int) and values[k] >= 0 for k in ("machine_rank", "num_machines")):
        return  # already reported as a bad value
    if values.get("machine_rank", 0) >= values.get("num_machines", 1):
        problems.append(Problem("machine_rank", f"{values['machine_rank']} must be below num_machines "
                                                f"({values['num_machines']}): ranks count from 0", where("machine_rank")))
    processes, machines = values.get("num_processes"), values.get("num_machines", 1)
    if processes is not None and processes < machines:
        problems.append(Problem("num_processes", f"{processes} is fewer than num_machines ({machines}); "
                                                 "num_processes counts processes on all machines", where("num_processes")))
    if machines > 1 and not (values.get("main_process_ip") or values.get("rdzv_endpoint")):
        problems.append(Problem("main_process_ip", f"must be set when num_machines is {machines} (the address of "
                                                   "machine 0), or set rdzv_endpoint", where("num_machines")))
    steps, plugin_steps = values.get("gradient_accumulation_steps"), values.get("gradient_accumulation_plugin.num_steps")
    if (plugin_steps is not None and steps not in (None, 1) and plugin_steps != steps
            and winners["gradient_accumulation_steps"].source.layer is not Layer.DEFAULT):
        problems.append(Problem("gradient_accumulation_steps", (
            f"{steps} disagrees with gradient_accumulation_plugin.num_steps = {plugin_steps} "
            f"({winners['gradient_accumulation_plugin.num_steps'].source}); set one of them"), where("gradient_accumulation_steps")))
    if values.get("use_cpu") and values.get("device") not in (None, "cpu"):
        problems.append(Problem("device", f"{values['device']!r} contradicts use_cpu: true", where("device")))
    if values.get("use_cpu") and values.get("gpu_ids") not in (None, "all"):  # 'all': what Accelerate's files say
        problems.append(Problem("gpu_ids", f"{values['gpu_ids']!r} has no effect with use_cpu: true (no GPU is used); "
                                "remove gpu_ids, or use_cpu to train on those GPUs", where("gpu_ids")))


def _declared_axes(schema: Schema) -> dict[str, tuple[str, ...]]:
    """``parallelism_config`` axes each installed strategy's manifest declares."""
    return {info.name: tuple(info.manifest.parallelism_axes) for info in schema.host.plugins("strategy")
            if info.manifest is not None}


def _declared_tp_styles(schema: Schema) -> dict[str, tuple[str, ...]]:
    """``tp_plan`` style names each installed strategy's manifest declares."""
    return {info.name: tuple(info.manifest.tp_styles) for info in schema.host.plugins("strategy")
            if info.manifest is not None}


def selected_plugin_keys(config: ResolvedConfig) -> list[str]:
    """``kind:name`` of every plugin the configuration selects explicitly."""
    keys = [f"strategy:{config['strategy']}", f"precision:{config['mixed_precision']}"]
    keys += [f"tracker:{name}" for name in config["log_with"] if isinstance(name, str) and name != "all"]
    for option, kind in (("device", "device"), ("cluster", "cluster")):
        if config.get(option):
            keys.append(f"{kind}:{config[option]}")
    if config.get("use_cpu"):
        keys.append("device:cpu")
    return keys


def _plugin_validation(host: PluginHost, config: ResolvedConfig) -> list[str]:
    """``torchrig_validate_config`` on the manifests of the selected plugins; problems found."""
    wanted = {f"{key}#manifest" for key in selected_plugin_keys(config)}
    problems: list[str] = []
    for owner, call in host.iter_impls("torchrig_validate_config", config=config):
        if owner not in wanted:
            continue
        for problem in call() or ():
            if isinstance(problem, ConfigProblem) and problem.where is None and problem.key in config.sources:
                source = config.sources[problem.key]
                problem = attrs.evolve(problem, where=_where(source))
            problems.append(str(problem))
    return problems


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
    "CONFIG_FILE_ENV",
    "CONFIG_HOME_ENV",
    "LAUNCH_OVERRIDES_ENV",
    "ConfigOverrideWarning",
    "Entry",
    "Layer",
    "Note",
    "ResolvedConfig",
    "Schema",
    "Source",
    "accelerate_default_config_path",
    "default_config_path",
    "encode_launch_overrides",
    "env_name",
    "launch_overrides",
    "machine_default_file",
    "resolve_config",
    "selected_plugin_keys",
]
