"""torchrig: write a PyTorch training loop once; run it on one CPU, many GPUs or many machines.

Top-level names are resolved lazily (PEP 562), so ``import torchrig`` costs almost nothing and
``torchrig --help`` never imports torch; a name is imported the first time it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from torchrig._version import __version__

#: Public name -> module that defines it.
_LAZY: dict[str, str] = {
    # the user API
    "Accelerator": "torchrig.accelerator",
    # plugin API
    "hookimpl": "torchrig.markers",
    "hookspec": "torchrig.markers",
    "HOOK_API_VERSION": "torchrig.hookspecs",
    "PluginManifest": "torchrig.manifest",
    "PluginHost": "torchrig.plugin_manager",
    "PluginKind": "torchrig.kinds",
    "PluginStatus": "torchrig.plugin_manager",
    "RunContext": "torchrig.run",
    "StepPlan": "torchrig.step_plan",
    "StepPlanBuilder": "torchrig.step_plan",
    "DeviceBackend": "torchrig.device",
    "Collectives": "torchrig.collectives",
    "Tracker": "torchrig.tracking",
    # data types exchanged through hooks
    "Capabilities": "torchrig.types",
    "CliFlag": "torchrig.types",
    "ClusterInfo": "torchrig.types",
    "ConfigProblem": "torchrig.types",
    "ConfigSection": "torchrig.types",
    "LaunchPlan": "torchrig.types",
    "PreparedModel": "torchrig.types",
    "Stash": "torchrig.types",
    "StashKey": "torchrig.types",
    # configuration (Accelerate's names)
    "DataLoaderConfiguration": "torchrig.config.options",
    "ProjectConfiguration": "torchrig.config.options",
    "GradientAccumulationPlugin": "torchrig.config.options",
    "AutocastKwargs": "torchrig.config.options",
    "GradScalerKwargs": "torchrig.config.options",
    "InitProcessGroupKwargs": "torchrig.config.options",
    "TorchDynamoPlugin": "torchrig.config.options",
    "ConfigOverrideWarning": "torchrig.config.resolve",
    "resolve_config": "torchrig.config.resolve",
    # errors
    "ConfigError": "torchrig.errors",
    "PluginError": "torchrig.errors",
    "PluginNotFoundError": "torchrig.errors",
    "PluginConflictError": "torchrig.errors",
    "PluginImportError": "torchrig.errors",
    "PluginAPIVersionError": "torchrig.errors",
    "PluginDisabledError": "torchrig.errors",
    "TorchrigError": "torchrig.errors",
}

__all__ = ["__version__", *sorted(_LAZY)]


#: Names provided by first-party plugins, and the pip requirement that installs each; used only
#: for the error message when the plugin is missing (installed plugins declare their exports).
_PLUGIN_EXPORT_HINTS: dict[str, str] = {
    "DistributedDataParallelKwargs": "torchrig-ddp",
    "FullyShardedDataParallelPlugin": "torchrig[fsdp]",
    "DeepSpeedPlugin": "torchrig[deepspeed]",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name[:1].isupper():
        value = _plugin_export(name)
    else:
        raise AttributeError(f"module 'torchrig' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def _plugin_export(name: str) -> Any:
    """``torchrig.DeepSpeedPlugin`` and friends: resolved from the installed plugin's manifest
    (its ``exports``), so the core never imports a plugin package by name."""
    from torchrig.discovery import load_reference
    from torchrig.plugin_manager import PluginHost

    for info in PluginHost(register_defaults=False).plugins():
        if info.manifest is not None and name in info.manifest.exports:
            return load_reference(info.manifest.exports[name])
    hint = _PLUGIN_EXPORT_HINTS.get(name)
    if hint is None:
        raise AttributeError(f"module 'torchrig' has no attribute {name!r}")
    raise ImportError(f"torchrig.{name} is provided by a plugin that is not installed: pip install '{hint}'", name=name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover
    from torchrig.accelerator import Accelerator
    from torchrig.collectives import Collectives
    from torchrig.device import DeviceBackend
    from torchrig.errors import (
        ConfigError,
        PluginAPIVersionError,
        PluginConflictError,
        PluginDisabledError,
        PluginError,
        PluginImportError,
        PluginNotFoundError,
        TorchrigError,
    )
    from torchrig.hookspecs import HOOK_API_VERSION
    from torchrig.kinds import PluginKind
    from torchrig.manifest import PluginManifest
    from torchrig.markers import hookimpl, hookspec
    from torchrig.plugin_manager import PluginHost, PluginStatus
    from torchrig.run import RunContext
    from torchrig.step_plan import StepPlan, StepPlanBuilder
    from torchrig.tracking import Tracker
    from torchrig.types import (
        Capabilities,
        CliFlag,
        ClusterInfo,
        ConfigProblem,
        ConfigSection,
        LaunchPlan,
        PreparedModel,
        Stash,
        StashKey,
    )
