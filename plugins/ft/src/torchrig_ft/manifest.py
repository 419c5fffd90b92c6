"""Manifest of the ``ft`` strategy: what torchrig knows about torchft replica groups without
importing torch or torchft.

Loaded for every run, ``torchrig launch --help``, ``torchrig config`` and ``torchrig plugins``;
must stay torch-free at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrig.plugin import HOOK_API_VERSION, CliFlag, ConfigProblem, ConfigSection, PluginManifest, hookimpl

from torchrig_ft.constants import SECTION

if TYPE_CHECKING:
    from torchrig.plugin import ResolvedConfig


class FTManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "torchft replica groups: data parallel across groups that drop out and rejoin without a restart"
    install_hint = "torchrig[ft]"
    requires = ("torchft",)
    parallelism_axes = ("dp_replicate",)  # every replica group holds a full replica
    exports = {"FTKwargs": "torchrig_ft.options:FTKwargs"}
    config_section = ConfigSection(SECTION, "torchrig_ft.options:FTKwargs",
                                   help="FTKwargs: torchft lighthouse address, replica group id, timeouts")
    cli_flags = (
        CliFlag("--ft_lighthouse", f"{SECTION}.lighthouse", "torchft lighthouse address (http://host:port)"),
        CliFlag("--ft_replica_id", f"{SECTION}.replica_id", "this replica group's name"),
        CliFlag("--ft_min_replicas", f"{SECTION}.min_replicas", "replica groups a step needs to commit",
                type="int"),
    )

    @hookimpl
    def torchrig_validate_config(self, config: ResolvedConfig) -> list[ConfigProblem]:
        """See :mod:`torchrig_ft.config_checks` (imported here: it reads the typed section, so it imports
        the options class, which a run that does not select ft never loads — benchmark B12)."""
        from torchrig_ft.config_checks import ft_problems

        return ft_problems(config)


__all__ = ["FTManifest"]
