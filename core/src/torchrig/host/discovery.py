"""Find installed plugins from package metadata, without importing them.

pluggy's ``load_setuptools_entrypoints`` silently skips a second plugin with a name already
registered and lets one plugin's ImportError crash everything, so torchrig scans
``importlib.metadata`` itself: every (kind, name) is recorded with the distribution(s) that
provide it, and nothing is imported here.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re
from collections.abc import Iterable
from typing import Any

import attrs

from torchrig.plugin.kinds import GROUPS, PluginKind

#: What every torchrig entry-point group's section header in ``entry_points.txt`` starts with.
GROUP_HEADER = "[torchrig."


def normalize_distribution_name(name: str) -> str:
    """PEP 503 normalisation: ``Torchrig_DDP`` and ``torchrig-ddp`` are one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


@attrs.frozen
class PluginRecord:
    """One (kind, name) as one distribution declares it."""

    kind: PluginKind
    name: str
    distribution: str
    version: str
    #: ``module:attr`` of the runtime object (group ``torchrig.<kind>s``).
    runtime: str | None = None
    #: ``module:attr`` of the manifest class (group ``torchrig.<kind>s.manifests``).
    manifest: str | None = None

    @property
    def key(self) -> str:
        return f"{self.kind.value}:{self.name}"

    @property
    def source(self) -> str:
        return f"{self.distribution} {self.version}"


def installed_distributions() -> list[md.Distribution]:
    """Installed distributions, one per name: the first on ``sys.path`` wins, as for imports.

    ``importlib.metadata.distributions()`` also yields shadowed copies (an editable install and
    a stale copy in site-packages); counting those would report false conflicts.
    """
    seen: set[str] = set()
    unique = []
    for dist in md.distributions():
        # The name from the metadata directory's path, when importlib has it: parsing every
        # distribution's METADATA costs tens of milliseconds on each start.
        name = getattr(dist, "_normalized_name", None) or dist.metadata["Name"]
        if not name:
            continue
        norm = normalize_distribution_name(name)
        if norm in seen:
            continue
        seen.add(norm)
        unique.append(dist)
    return unique


def scan(distributions: Iterable[md.Distribution]) -> list[PluginRecord]:
    """Every plugin the distributions declare, one record per (distribution, kind, name)."""
    found: dict[tuple[str, PluginKind, str], dict[str, str]] = {}
    versions: dict[str, str] = {}
    for dist in distributions:
        # Most distributions declare no torchrig group: skip them on the raw text rather than
        # parse every distribution's entry points (~200 on a typical machine, on each start).
        text = dist.read_text("entry_points.txt")
        if not text or GROUP_HEADER not in text:
            continue
        entry_points = [ep for ep in dist.entry_points if ep.group in GROUPS]
        if not entry_points:  # most distributions: no metadata to parse
            continue
        metadata = dist.metadata  # parsed once: ``dist.version`` would parse it again
        dist_name = metadata["Name"]
        if not dist_name:
            continue
        versions[dist_name] = metadata["Version"]
        for ep in entry_points:
            kind, is_manifest = GROUPS[ep.group]
            slot = found.setdefault((dist_name, kind, ep.name), {})
            slot["manifest" if is_manifest else "runtime"] = ep.value
    return [
        PluginRecord(
            kind=kind,
            name=name,
            distribution=dist_name,
            version=versions[dist_name],
            runtime=refs.get("runtime"),
            manifest=refs.get("manifest"),
        )
        for (dist_name, kind, name), refs in sorted(found.items(), key=lambda item: (item[0][1].value, item[0][2], item[0][0]))
    ]


def load_reference(ref: str) -> Any:
    """Import ``module:attr.sub`` (entry-point value syntax) and return the object."""
    module_name, _, attr_path = ref.partition(":")
    obj: Any = importlib.import_module(module_name.strip())
    for part in filter(None, attr_path.strip().split(".")):
        obj = getattr(obj, part)
    return obj


__all__ = ["GROUP_HEADER", "PluginRecord", "installed_distributions", "load_reference", "normalize_distribution_name", "scan"]
