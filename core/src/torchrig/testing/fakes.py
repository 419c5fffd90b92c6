"""Fake distributions and modules: test plugin discovery without installing anything.

A :class:`FakeDistribution` is a real ``importlib.metadata.Distribution`` whose metadata and
``entry_points.txt`` come from memory, so discovery parses it exactly as it parses installed
packages. Entry points must resolve to importable objects: :class:`FakeModules` puts modules
into ``sys.modules`` for the duration of a test.
"""

from __future__ import annotations

import importlib.metadata as md
import pathlib
import sys
import types
from collections.abc import Iterable, Mapping
from typing import Any

from torchrig.plugin.kinds import PluginKind


class FakeDistribution(md.Distribution):
    """An in-memory distribution: ``name``, ``version`` and ``{group: {name: "module:attr"}}``."""

    def __init__(self, name: str, version: str = "0.0.0", entry_points: Mapping[str, Mapping[str, str]] | None = None):
        self._name = name
        self._version = version
        self._entry_points = {group: dict(eps) for group, eps in (entry_points or {}).items()}

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return f"Metadata-Version: 2.1\nName: {self._name}\nVersion: {self._version}\n"
        if filename == "entry_points.txt":
            lines = []
            for group, eps in self._entry_points.items():
                lines.append(f"[{group}]")
                lines.extend(f"{name} = {value}" for name, value in eps.items())
                lines.append("")
            return "\n".join(lines)
        return None

    def locate_file(self, path: Any) -> pathlib.Path:
        return pathlib.Path(str(path))

    def __repr__(self) -> str:
        return f"FakeDistribution({self._name!r}, {self._version!r})"


def plugin_distribution(
    name: str,
    version: str = "0.0.0",
    plugins: Iterable[tuple[str | PluginKind, str, str | None, str | None]] = (),
) -> FakeDistribution:
    """A fake distribution declaring plugins as ``(kind, name, runtime_ref, manifest_ref)``;
    a ``None`` ref leaves that entry point out (to test incomplete plugins)."""
    entry_points: dict[str, dict[str, str]] = {}
    for kind, plugin_name, runtime, manifest in plugins:
        kind = PluginKind.parse(kind) if isinstance(kind, str) else kind
        if runtime is not None:
            entry_points.setdefault(kind.runtime_group, {})[plugin_name] = runtime
        if manifest is not None:
            entry_points.setdefault(kind.manifest_group, {})[plugin_name] = manifest
    return FakeDistribution(name, version, entry_points)


class FakeModules:
    """Create importable modules in ``sys.modules``; ``cleanup()`` removes them."""

    def __init__(self) -> None:
        self._names: list[str] = []

    def add(self, name: str, **attributes: Any) -> types.ModuleType:
        if name in sys.modules and name not in self._names:
            raise ValueError(f"module {name!r} already exists; pick a unique fake module name")
        module = types.ModuleType(name)
        module.__dict__.update(attributes)
        sys.modules[name] = module
        self._names.append(name)
        return module

    def cleanup(self) -> None:
        for name in reversed(self._names):
            sys.modules.pop(name, None)
        self._names.clear()


__all__ = ["FakeDistribution", "FakeModules", "plugin_distribution"]
