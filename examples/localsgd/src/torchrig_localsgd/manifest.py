"""Manifest of the ``localsgd`` strategy: what torchrig knows about it without importing torch.

Loaded for every run and for ``torchrig launch --help``, ``torchrig config`` and ``torchrig
plugins``; it must stay importable without torch.
"""

from __future__ import annotations

from torchrig.plugin import HOOK_API_VERSION, CliFlag, ConfigSection, PluginManifest

SECTION = "localsgd_config"


class LocalSGDManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "local SGD: every rank steps on its own data, parameters are averaged every K optimizer steps"
    install_hint = "torchrig-localsgd"
    distributed_type = "MULTI_{device}"  # data parallel over the selected device, as DDP
    exports = {"LocalSGDKwargs": "torchrig_localsgd.options:LocalSGDKwargs"}
    # By reference: the options module is imported only by runs that use localsgd_config.
    config_section = ConfigSection(SECTION, "torchrig_localsgd.options:LocalSGDKwargs",
                                   help="LocalSGDKwargs: how often parameters are averaged")
    cli_flags = (
        CliFlag("--localsgd_sync_every", f"{SECTION}.sync_every",
                "average parameters across ranks every K optimizer steps", type="int", metavar="K"),
        CliFlag("--localsgd_average_buffers", f"{SECTION}.average_buffers",
                "average floating-point buffers with the parameters", type="bool"),
    )


__all__ = ["SECTION", "LocalSGDManifest"]
