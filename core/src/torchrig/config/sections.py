"""Which configuration keys exist: the core's options and every installed plugin's section.

A section declares its options class directly or as a ``module:Class`` reference
(:class:`~torchrig.plugin.types.ConfigSection`). A referenced class is imported only when a run uses
its section — a source sets one of its keys, or the selected plugin reads it — so a plugin that
is installed but not used costs a run no import of its options (a start stays as fast with ten
plugins installed as with one). Listing every key (``torchrig config``, the docs) imports all.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from torchrig.config import compat
from torchrig.config.options import CoreOptions
from torchrig.config.schema import FieldSpec, Problem, field_specs
from torchrig.errors import PluginError
from torchrig.host.discovery import load_reference
from torchrig.host.plugin_host import PluginHost
from torchrig.plugin.types import ConfigSection

#: Options classes imported from their references, by reference (once per process).
_LOADED: dict[str, type] = {}


def options_reference(options: type | str) -> str:
    """``module:Class`` of an options class (a reference is returned as it is): how a section's
    class is matched without importing it."""
    return options if isinstance(options, str) else f"{options.__module__}:{options.__qualname__}"


def options_class(section: ConfigSection) -> type:
    """The attrs options class of ``section``, imported on first use when it is a reference."""
    if not isinstance(section.options, str):
        return section.options
    cls = _LOADED.get(section.options)
    if cls is None:
        try:
            cls = load_reference(section.options)
        except Exception as exc:
            raise PluginError(f"configuration section {section.key!r}: its options class {section.options!r} failed to "
                              f"import: {type(exc).__name__}: {exc}") from exc
        if not (isinstance(cls, type) and attrs.has(cls)):
            raise PluginError(f"configuration section {section.key!r}: {section.options!r} is not an attrs options class")
        if options_reference(cls) != section.options:
            raise PluginError(f"configuration section {section.key!r}: {section.options!r} names "
                              f"{options_reference(cls)}; reference the class where it is defined")
        _LOADED[section.options] = cls
    return cls


class Schema:
    """All keys torchrig accepts, derived from the core's and the plugins' options classes."""

    def __init__(self, host: PluginHost) -> None:
        self.host = host
        self.problems: list[Problem] = []
        self.root: dict[str, FieldSpec] = field_specs(CoreOptions)
        self.root_index: dict[str, str] = {}
        for name, spec in self.root.items():
            self.root_index[name] = name
            for alias in spec.info.aliases:
                self.root_index[alias] = name
        self.sections: dict[str, ConfigSection] = {}
        self.section_owner: dict[str, str] = {}
        self.section_index: dict[str, str] = {}
        for owner, section in self._declared_sections():
            if section.key in self.sections or section.key in self.root_index:
                first = self.section_owner.get(section.key, "the core")
                self.problems.append(Problem(section.key, f"declared by both {first} and {owner}; uninstall or disable one"))
                continue
            self.sections[section.key] = section
            self.section_owner[section.key] = owner
            for alias in (section.key, *section.aliases):
                self.section_index[alias] = section.key
        self._fields: dict[str, dict[str, FieldSpec]] = {}
        self._key_index: dict[str, dict[str, str]] = {}

    def _declared_sections(self) -> Iterator[tuple[str, ConfigSection]]:
        for owner, call in self.host.iter_impls("torchrig_config_sections"):
            for section in call() or ():
                yield ("the core" if owner == "core:defaults" else owner.removesuffix("#manifest")), section

    # -- one section (imports its options class when it is a reference) ------------------------

    def options(self, section: str) -> type:
        return options_class(self.sections[section])

    def fields(self, section: str) -> dict[str, FieldSpec]:
        """The fields of ``section``, by name."""
        specs = self._fields.get(section)
        if specs is None:
            specs = self._fields[section] = field_specs(self.options(section))
        return specs

    def key_index(self, section: str) -> dict[str, str]:
        """Accepted spelling in ``section`` (name or alias) -> field name."""
        index = self._key_index.get(section)
        if index is None:
            index = {}
            for name, spec in self.fields(section).items():
                index[name] = name
                for alias in spec.info.aliases:
                    index[alias] = name
            self._key_index[section] = index
        return index

    def is_deferred(self, section: str) -> bool:
        """Whether ``section`` declares its options class by reference: untouched by every source,
        it is built when first read (the same in every run of a process, loaded or not)."""
        return isinstance(self.sections[section].options, str)

    def spec(self, key: str) -> FieldSpec:
        section, _, name = key.rpartition(".")
        return self.fields(section)[name] if section else self.root[name]

    def has_key(self, key: str) -> bool:
        """Whether ``key`` exists (imports only its own section's class)."""
        section, _, name = key.rpartition(".")
        return name in self.fields(section) if section in self.sections else (not section and name in self.root)

    # -- everything (imports every section's class: for listings and error hints) --------------

    @property
    def section_fields(self) -> dict[str, dict[str, FieldSpec]]:
        return {key: self.fields(key) for key in self.sections}

    def all_keys(self) -> list[str]:
        keys = list(self.root)
        for section in self.sections:
            keys.extend(f"{section}.{name}" for name in self.fields(section))
        return keys

    def top_level_spellings(self) -> list[str]:
        return [*self.root_index, *self.section_index, *compat.BY_KEY]

    def plugin_lookup(self, kind: str) -> dict[str, str]:
        """Lower-cased name or alias -> plugin name, for every discovered plugin of ``kind``."""
        lookup: dict[str, str] = {}
        for info in self.host.plugins(kind):
            lookup[info.name.lower()] = info.name
            if info.manifest is not None:
                for alias in info.manifest.aliases:
                    lookup.setdefault(alias.lower(), info.name)
        return lookup


__all__ = ["Schema", "options_class", "options_reference"]
