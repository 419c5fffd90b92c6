"""The per-process run context passed to every runtime hook.

State lives here, not in module globals, so two Accelerators in one process (tests,
notebooks) never corrupt each other: each has its own plugin manager and its own run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from torchrig.config.resolved import ResolvedConfig
from torchrig.config.sources import Source
from torchrig.plugin.types import Capabilities, ClusterInfo, Stash

T = TypeVar("T")

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.distributed.collectives import Collectives
    from torchrig.distributed.device import DeviceBackend
    from torchrig.host.plugin_host import PluginHost


def _resolved(config: object) -> ResolvedConfig:
    """Refuse anything but a :class:`ResolvedConfig` (a plain mapping has no sources, no typed
    sections and no defaults: every reader would need a fallback)."""
    if not isinstance(config, ResolvedConfig):
        raise TypeError(
            f"RunContext(config=...) takes the run's ResolvedConfig, not a {type(config).__name__}: resolve the "
            "configuration once with torchrig.config.resolve.resolve_config(host, arguments={...}) (in tests: "
            "torchrig.testing.resolved_config({...}))")
    return config


@attrs.define(eq=False)
class RunContext:
    """One process's view of the run: configuration, where it sits, which device, what the
    strategy owns, and a :class:`~torchrig.plugin.types.Stash` for plugin data."""

    #: The resolved configuration: typed sections (:meth:`section`), each value's source, ``is_set``.
    config: ResolvedConfig = attrs.field(converter=_resolved)
    #: The plugin host that created this run.
    plugins: PluginHost | None = None
    cluster: ClusterInfo = attrs.field(factory=ClusterInfo)
    device: DeviceBackend | None = None
    collectives: Collectives | None = None
    capabilities: Capabilities | None = None
    stash: Stash = attrs.field(factory=Stash)
    #: True once ``torchrig_unconfigure`` was called for this run (it is called once).
    ended: bool = False
    #: True when this process plans the run (``torchrig plan``): the process group is torch's fake
    #: one and the model lives on the meta device. Strategies lay the model out exactly as in the
    #: real run (same mesh, plans, wrapping, stages, errors) but move, materialise, load or
    #: broadcast nothing (see ``torchrig_prepare_model``).
    planning: bool = False

    def section(self, options: type[T]) -> T:
        """A configuration section as its typed options object, found by class — the one way plugins
        read their configuration, so each default lives once, on the class:
        ``run.section(FullyShardedDataParallelPlugin)``, the core's ``run.section(ParallelismConfig)``,
        and the top-level keys ``run.section(CoreOptions).mixed_precision``."""
        return self.config.section_of(options)

    def option(self, key: str) -> Any:
        """The core's own reads of a value by dotted key (a KeyError names an undeclared key).
        Plugins read :meth:`section` instead."""
        return self.config[key]

    def option_source(self, key: str) -> Source | None:
        """Where the value of ``key`` came from (its layer and place: file:line, variable, flag), or
        None when no layer declares ``key``."""
        return self.config.sources.get(key)


__all__ = ["RunContext"]
