"""Layering the sources and turning the winners into typed values.

The lowest layer (every key's default), the merge in which a later layer wins (noting where one
overrides the script's explicit argument), coercion of each winning value to its key's type,
plugin names and aliases to installed names, and the options objects built from the values.
Separate from :mod:`torchrig.config.resolve`, which only orders these steps, and from the readers,
which know each source's spelling but not precedence.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from torchrig.config import compat
from torchrig.config.options import CoreOptions
from torchrig.config.readers import location_of
from torchrig.config.schema import CoercionError, Problem, build_options, coerce, suggest
from torchrig.config.sections import Schema
from torchrig.config.sources import Entry, Layer, Source
from torchrig.host.plugin_host import PluginStatus


def defaults_layer(schema: Schema, sections: Iterable[str]) -> dict[str, Entry]:
    """The lowest layer: the core's defaults and those of ``sections``."""
    source = Source(Layer.DEFAULT)
    entries = {name: Entry(spec.default(), source) for name, spec in schema.root.items()}
    for key in sections:
        entries.update(section_defaults(schema, key, source))
    return entries


def section_defaults(schema: Schema, key: str, source: Source) -> dict[str, Entry]:
    base = schema.sections[key].default
    return {f"{key}.{name}": Entry(getattr(base, name) if base is not None else (spec.default() if spec.has_default
                                                                                 else None), source)
            for name, spec in schema.fields(key).items()}



def merge_layers(schema: Schema, layers: list[dict[str, Entry]]) -> tuple[dict[str, Entry], list[tuple[str, str]]]:
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
    except (CoercionError, TypeError, ValueError):  # a bad value is reported by coerce_all
        return False


def coerce_all(schema: Schema, winners: Mapping[str, Entry], problems: list[Problem]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, entry in winners.items():
        spec = schema.spec(key)
        value = entry.value
        if spec.info.python_only and entry.source.layer not in (Layer.DEFAULT, Layer.ARGUMENT):
            problems.append(Problem(key, "can only be set from Python (Accelerator arguments)", location_of(entry.source)))
            continue
        try:
            if spec.info.normalize is not None:
                value = spec.info.normalize(value)
            value = coerce(value, spec.type, entry.raw)
        except CoercionError as exc:
            problems.append(Problem(key, str(exc), location_of(entry.source)))
            continue
        if spec.info.choices and value is not None and value not in spec.info.choices:
            problems.append(Problem(key, f"must be one of {', '.join(spec.info.choices)}, got {value!r}"
                                         f"{suggest(str(value), spec.info.choices)}", location_of(entry.source)))
            continue
        values[key] = value
    return values


def resolve_plugin_names(schema: Schema, values: dict[str, Any], winners: Mapping[str, Entry],
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
                                             f"installed: {', '.join(installed)}{fix}", location_of(winners[key].source)))
                continue
            resolved.append(name)
        values[key] = resolved if isinstance(given, list) else (resolved[0] if resolved else None)


def build_options_objects(schema: Schema, values: dict[str, Any], winners: Mapping[str, Entry], problems: list[Problem],
           section_keys: Iterable[str], *, core: bool = True) -> tuple[CoreOptions | None, dict[str, Any]]:
    def build(cls: type, prefix: str, names: Iterable[str]) -> Any:
        given = {name: values[f"{prefix}{name}"] for name in names if f"{prefix}{name}" in values}
        obj, found = build_options(cls, given, path=prefix.rstrip("."))
        for problem in found:
            entry = winners.get(problem.path)
            problem.where = location_of(entry.source) if entry else None
        problems.extend(found)
        return obj

    built_core = build(CoreOptions, "", schema.root) if core else None
    sections = {key: build(schema.options(key), f"{key}.", schema.fields(key)) for key in section_keys}
    return built_core, sections


def choose_default_strategy(schema: Schema, values: dict[str, Any], winners: dict[str, Entry],
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
