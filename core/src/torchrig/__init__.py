"""torchrig: write a PyTorch training loop once; run it on one CPU, many GPUs or many machines.

Top-level names are resolved lazily (PEP 562), so ``import torchrig`` costs almost nothing and
``torchrig --help`` never imports torch; a name is imported the first time it is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import os as _os
from typing import TYPE_CHECKING, Any

from torchrig._version import __version__

if _os.environ.get("TORCHRIG_PREEMPTION__SIGNALS"):
    # A scheduler's warning that arrives before the Accelerator exists is kept for its first step
    # boundary, not fatal (docs/preemption.md); torch-free, a few signal.signal calls.
    from torchrig.preemption import install_from_environment as _install_preemption_handlers

    _install_preemption_handlers()

#: Public name -> module that defines it.
_LAZY: dict[str, str] = {
    # the user API
    "Accelerator": "torchrig.accelerator",
    # Accelerate has it only in accelerate.state; scripts reach for it beside PartialState
    "AcceleratorState": "torchrig.process",
    # plugin API
    "hookimpl": "torchrig.markers",
    "hookspec": "torchrig.markers",
    "HOOK_API_VERSION": "torchrig.hookspecs",
    "PluginManifest": "torchrig.manifest",
    "PluginHost": "torchrig.plugin_host",
    "PluginKind": "torchrig.kinds",
    "PluginStatus": "torchrig.plugin_host",
    "RunContext": "torchrig.run",
    "StepPlan": "torchrig.step_plan",
    "StepPlanBuilder": "torchrig.step_plan",
    "DeviceBackend": "torchrig.device",
    "Collectives": "torchrig.collectives",
    "Tracker": "torchrig.tracker",
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


def __getattr__(name: str) -> Any:
    """torchrig's own names (``_LAZY``), then Accelerate's top-level names (from the declared table
    in :mod:`torchrig.compat.accelerate_names`), then any other name an installed plugin exports."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name.startswith("__"):
        raise AttributeError(f"module 'torchrig' has no attribute {name!r}")
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # ``from torchrig import <submodule>`` asks here before importing it: answer at the cost of
        # a directory lookup, not of the Accelerate name table (the worker wrapper does this).
        raise AttributeError(f"module 'torchrig' has no attribute {name!r} (a submodule: import it)")
    else:
        value = _compat_or_plugin_export(name)
    globals()[name] = value  # later lookups skip this function
    return value


def _compat_or_plugin_export(name: str) -> Any:
    """Accelerate's top-level names from the declared table (plain data, cheap to read), and
    class-like names plugins export; other names fail at once, without importing the plugin host
    (``from torchrig import <submodule>`` asks here first)."""
    table = importlib.import_module("torchrig.compat.accelerate_names").TABLE["accelerate"]
    if name in table:
        return importlib.import_module("torchrig.compat.resolve").resolve("accelerate", name)
    if name[:1].isupper():
        value = importlib.import_module("torchrig.compat.resolve").plugin_export(name)
        if value is not None:
            return value
    raise AttributeError(f"module 'torchrig' has no attribute {name!r}")


def __dir__() -> list[str]:
    table = importlib.import_module("torchrig.compat.accelerate_names").TABLE["accelerate"]
    return sorted(set(globals()) | set(_LAZY) | set(table))


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
    from torchrig.plugin_host import PluginHost, PluginStatus
    from torchrig.run import RunContext
    from torchrig.step_plan import StepPlan, StepPlanBuilder
    from torchrig.tracker import Tracker
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
