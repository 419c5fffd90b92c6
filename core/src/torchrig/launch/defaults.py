"""The core's launch default: ``torchrig_launch`` starts the workers with torch elastic.
Registered as ``"core:launch-defaults"`` by the launcher's host (:func:`launcher_host`)."""

from __future__ import annotations

from torchrig.host.plugin_host import PluginHost
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import LaunchPlan

#: The pluggy name of this family.
NAME = "core:launch-defaults"


class LaunchDefaults:
    """What the launcher does when no cluster plugin launches the job itself."""

    @hookimpl(trylast=True)
    def torchrig_launch(self, plan: LaunchPlan) -> int:
        # Imported here, not at the top: torch elastic imports torch, and the launcher parses its
        # flags (--help, --dry-run) without torch.
        from torchrig.launch.elastic import launch_with_elastic

        return launch_with_elastic(plan)


def register(host: PluginHost) -> None:
    """Add the launch default to ``host`` (once)."""
    host.register_default(LaunchDefaults(), NAME)


def launcher_host() -> PluginHost:
    """The launcher's :class:`PluginHost`: the configuration defaults plus the launch default."""
    host = PluginHost()
    register(host)
    return host


__all__ = ["NAME", "LaunchDefaults", "launcher_host", "register"]
