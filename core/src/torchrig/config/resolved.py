"""The resolved configuration of one run (:class:`ResolvedConfig`): typed values by dotted key,
each with its source, and each section as its options object.

A section no source set a key of, whose options class is a reference not imported yet (a
plugin the run does not use), holds nothing but its defaults: it is built the first time
anything reads it (:class:`DeferredSections`), with the same coercion and checks as the others.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import attrs

from torchrig.config.options import CoreOptions
from torchrig.config.sections import options_reference
from torchrig.config.sources import Layer, Note, Source
from torchrig.plugin.types import ConfigSection

T = TypeVar("T")

#: Builds one deferred section: its ``{dotted key: value}``, ``{dotted key: Source}`` and options object.
SectionBuilder = Callable[[str], tuple[dict[str, Any], dict[str, Source], Any]]


class DeferredSections:
    """The sections of a run built on first use, and the three tables they fill in then."""

    def __init__(self, pending: Iterable[str], build: SectionBuilder, order: Callable[[], list[str]]) -> None:
        self.pending = dict.fromkeys(pending)
        self._build, self._order = build, order
        self.tables: tuple[_Table, _Table, _Table] | None = None  # values, sources, sections

    def load_for(self, key: str) -> None:
        """Build the deferred section that ``key`` (a dotted key or a section key) belongs to."""
        section = key if key in self.pending else key.rpartition(".")[0]
        if section in self.pending:
            self._load(section)

    def load_all(self) -> None:
        if not self.pending:
            return
        for section in list(self.pending):
            self._load(section)
        assert self.tables is not None
        values, sources, _ = (table.data for table in self.tables)
        for data in (values, sources):  # the order of an eager resolution: the schema's
            ordered = [(key, data[key]) for key in self._order() if key in data]
            data.clear()
            data.update(ordered)

    def _load(self, section: str) -> None:
        assert self.tables is not None
        del self.pending[section]
        values, sources, obj = self._build(section)
        self.tables[0].data.update(values)
        self.tables[1].data.update(sources)
        self.tables[2].data[section] = obj


class _Table(Mapping[str, Any]):
    """A table of a :class:`ResolvedConfig` (values, sources or sections) that builds a deferred
    section when one of its keys is looked up, and every deferred section before it is listed or
    compared. A mapping, not a dict: no dict fast path (``==``, ``dict(...)``, ``json``) can see a
    table with sections still missing."""

    def __init__(self, data: dict[str, Any], deferred: DeferredSections) -> None:
        self.data, self._deferred = data, deferred

    def __getitem__(self, key: str) -> Any:
        try:
            return self.data[key]
        except KeyError:
            self._deferred.load_for(key)
            return self.data[key]

    def __contains__(self, key: object) -> bool:
        if key in self.data:
            return True
        if isinstance(key, str):
            self._deferred.load_for(key)
        return key in self.data

    def __iter__(self) -> Iterator[str]:
        self._deferred.load_all()
        return iter(self.data)

    def __len__(self) -> int:
        self._deferred.load_all()
        return len(self.data)

    def __repr__(self) -> str:
        self._deferred.load_all()
        return repr(self.data)


def lazy_tables(values: dict[str, Any], sources: dict[str, Source], sections: dict[str, Any],
                deferred: DeferredSections) -> tuple[Mapping[str, Any], Mapping[str, Source], Mapping[str, Any]]:
    """The three tables of a :class:`ResolvedConfig`, completed from ``deferred`` on use."""
    tables = (_Table(values, deferred), _Table(sources, deferred), _Table(sections, deferred))
    deferred.tables = tables
    return tables


@attrs.frozen(eq=False)
class ResolvedConfig(Mapping[str, Any]):
    """The configuration of one run: typed values by dotted key, each with its source.

    ``config["mixed_precision"]``, ``config.source("mixed_precision")``,
    ``config.section("fsdp_config")`` (the plugin's typed options object), ``config.core``.
    """

    values: Mapping[str, Any]
    sources: Mapping[str, Source]
    core: CoreOptions
    sections: Mapping[str, Any]
    notes: tuple[Note, ...] = ()
    warnings: tuple[str, ...] = ()
    #: Every declared section (key -> declaration): finds a section by its options class
    #: without importing the classes of sections nobody used.
    declared: Mapping[str, ConfigSection] = attrs.field(factory=dict, repr=False)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def source(self, key: str) -> Source:
        return self.sources[key]

    def section(self, key: str) -> Any:
        return self.sections[key]

    def section_of(self, options: type[T]) -> T:
        """The section whose options object is an ``options`` (its attrs class): the typed way to
        read a section, with each default declared once, on the class. ``CoreOptions`` gives the
        top-level keys (``mixed_precision``, ``strategy``...)."""
        if options is CoreOptions:
            return self.core  # type: ignore[return-value]  # the top-level keys are the core's own section
        reference = options_reference(options)
        keys = [key for key, section in self.declared.items() if options_reference(section.options) == reference]
        if len(keys) != 1:
            raise KeyError(f"{'no' if not keys else 'more than one'} configuration section of type "
                           f"{options.__qualname__} in this run; sections: {', '.join(sorted(self.declared))}")
        return self.sections[keys[0]]

    def is_set(self, key: str) -> bool:
        """Whether any source other than the defaults set ``key``."""
        return self.sources[key].layer is not Layer.DEFAULT

    def explain(self) -> list[tuple[str, Any, Source]]:
        return [(key, self.values[key], self.sources[key]) for key in self.values]

    def to_nested(self, *, only_set: bool = False) -> dict[str, Any]:
        """Nested mapping as a config file writes it (``only_set``: skip default values)."""
        out: dict[str, Any] = {}
        for key, value in self.values.items():
            if only_set and not self.is_set(key):
                continue
            section, _, name = key.rpartition(".")
            (out.setdefault(section, {}) if section else out)[name] = value
        return out


__all__ = ["DeferredSections", "ResolvedConfig", "SectionBuilder", "lazy_tables"]
