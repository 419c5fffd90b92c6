"""The per-process run context passed to every runtime hook.

State lives here, not in module globals, so two Accelerators in one process (tests,
notebooks) never corrupt each other: each has its own plugin manager and its own run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from torchrig.config.options import CORE_SECTIONS
from torchrig.config.resolved import ResolvedConfig
from torchrig.config.sections import Schema, options_reference
from torchrig.config.sources import Source
from torchrig.plugin.types import Capabilities, ClusterInfo, Stash

T = TypeVar("T")

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.distributed.collectives import Collectives
    from torchrig.distributed.device import DeviceBackend
    from torchrig.host.plugin_host import PluginHost


@attrs.define(eq=False)
class RunContext:
    """One process's view of the run: configuration, where it sits, which device, what the
    strategy owns, and a :class:`~torchrig.plugin.types.Stash` for plugin data."""

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

    def option_source(self, key: str) -> Source | None:
        """Where the value of ``key`` came from (its layer and place: file:line, variable, flag),
        or None when the run's configuration is a plain mapping (test and contract kits build
        such runs: every key there is given) or no layer declares ``key``."""
        if isinstance(self.config, ResolvedConfig):
            return self.config.sources.get(key)
        return None

    def section(self, options: type[T]) -> T:
        """A configuration section as its typed options object, found by class
        (``run.section(FullyShardedDataParallelPlugin)``) — how plugins read their options, so
        each default lives once, on the class.

        A run whose configuration is a plain mapping (test and contract kits build such runs) gets
        one made from the section's dotted keys; the plugin host tells under which key the class
        is declared (the core's own sections are known without one).
        """
        if isinstance(self.config, ResolvedConfig):
            return self.config.section_of(options)
        declared = (Schema(self.plugins).sections.values() if self.plugins is not None else CORE_SECTIONS)
        reference = options_reference(options)
        keys = [section.key for section in declared if options_reference(section.options) == reference]
        if not keys:
            raise KeyError(f"no installed plugin declares a configuration section of type {options.__qualname__}")
        prefix = keys[0] + "."
        return options(**{key[len(prefix):]: value for key, value in self.config.items() if key.startswith(prefix)})


__all__ = ["RunContext"]
