"""The per-process run context passed to every runtime hook.

State lives here, not in module globals, so two Accelerators in one process (tests,
notebooks) never corrupt each other: each has its own plugin manager and its own run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from torchrig.types import Capabilities, ClusterInfo, Stash

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.collectives import Collectives
    from torchrig.device import DeviceBackend
    from torchrig.plugin_manager import PluginHost


@attrs.define(eq=False)
class RunContext:
    """One process's view of the run: configuration, where it sits, which device, what the
    strategy owns, and a :class:`~torchrig.types.Stash` for plugin data."""

    #: The resolved configuration (dotted keys, e.g. ``"mixed_precision"``).
    config: Mapping[str, Any] = attrs.field(factory=dict)
    #: The plugin host that created this run.
    plugins: PluginHost | None = None
    cluster: ClusterInfo = attrs.field(factory=ClusterInfo)
    device: DeviceBackend | None = None
    collectives: Collectives | None = None
    capabilities: Capabilities | None = None
    stash: Stash = attrs.field(factory=Stash)
    #: True once ``torchrig_unconfigure`` was called for this run (it is called once).
    ended: bool = False

    def option(self, key: str, default: Any = None) -> Any:
        """A configuration value by dotted key, or ``default``."""
        return self.config.get(key, default)


__all__ = ["RunContext"]
