"""Plugin kinds and the entry-point groups that declare them.

Each kind has two entry-point groups, so that what is installed, and under which name, is
known from package metadata without importing anything:

* ``torchrig.<kind>s``            the *runtime* object, imported only when the plugin is used;
* ``torchrig.<kind>s.manifests``  the torch-free *manifest* (options class, CLI flags,
  validation, hook-API version), loaded for every installed plugin.

The entry-point name is the user-facing name (``strategy: ddp``, ``log_with: [wandb]``).
"""

from __future__ import annotations

import enum


class PluginKind(str, enum.Enum):
    """The kinds of plugin torchrig selects between, in registration order."""

    CLUSTER = "cluster"
    DEVICE = "device"
    PRECISION = "precision"
    STRATEGY = "strategy"
    TRACKER = "tracker"

    @property
    def plural(self) -> str:
        return "strategies" if self is PluginKind.STRATEGY else f"{self.value}s"

    @property
    def runtime_group(self) -> str:
        return f"torchrig.{self.plural}"

    @property
    def manifest_group(self) -> str:
        return f"{self.runtime_group}.manifests"

    @property
    def auto_detected(self) -> bool:
        """Kinds whose installed plugins are all asked, by priority, instead of one being chosen."""
        return self in (PluginKind.CLUSTER, PluginKind.DEVICE)

    @property
    def multiple(self) -> bool:
        """Kinds of which a run may select several plugins at once."""
        return self is PluginKind.TRACKER

    @classmethod
    def parse(cls, value: str) -> PluginKind:
        text = value.strip().lower()
        for kind in cls:
            if text in (kind.value, kind.plural):
                return kind
        choices = ", ".join(k.value for k in cls)
        raise ValueError(f"unknown plugin kind {value!r}; expected one of: {choices}")


#: Registration (and thus reporting) order of kinds; fixed and documented in docs/architecture.md.
KIND_ORDER: tuple[PluginKind, ...] = tuple(PluginKind)

#: group name -> (kind, is_manifest)
GROUPS: dict[str, tuple[PluginKind, bool]] = {
    **{k.runtime_group: (k, False) for k in PluginKind},
    **{k.manifest_group: (k, True) for k in PluginKind},
}

__all__ = ["GROUPS", "KIND_ORDER", "PluginKind"]
