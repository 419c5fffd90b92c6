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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchrig' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


if TYPE_CHECKING:  # pragma: no cover
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
