"""torchrig: write a PyTorch training loop once; run it on one CPU, many GPUs or many machines.

Top-level names are resolved lazily (PEP 562), so ``import torchrig`` costs almost nothing and
``torchrig --help`` never imports torch; a name is imported the first time it is used.

What lives at the top level of the package (docs/architecture.md, "The top level"; tests/repository/test_layers.py
keeps it so), and nothing else:

* **Concept packages**, each a noun a newcomer can name: ``accelerator`` (the user API and its parts),
  ``plugin`` (what a plugin is made of: the hook contract, markers, manifest, data types), ``host``
  (discovering, registering and assembling plugins into a run), ``config``, ``distributed``, ``training``,
  ``data``, ``checkpoint``, ``tracking``, ``resilience``, ``estimate``, ``launch``, ``cli``, ``builtins``
  (the core's own plugins), ``defaults`` (its default hook implementations), ``compat`` (Accelerate's
  names), ``testing`` and ``utils``. A new concept gets a package, never a family of prefixed modules.
* **Accelerate's module paths** that the rename rule (``accelerate`` -> ``torchrig``) needs:
  ``state``, ``checkpointing``, ``data_loader``, ``launchers``, ``big_modeling``, ``local_sgd``,
  ``logging``, ``optimizer``, ``scheduler`` (and the packages ``utils``, ``tracking``, ``accelerator``).
  Such a module holds its code when that code is the whole concept (``optimizer``, ``scheduler``,
  ``logging``, ``local_sgd``); otherwise it is a thin mirror whose names resolve from the declared table
  in :mod:`torchrig.compat.accelerate_names`.
* ``errors``, which users and plugins both catch, and the package's own files (``__main__``, ``_version``).

Plugin authors import from :mod:`torchrig.plugin`; paths that moved in 0.2 stay importable for one
release (:mod:`torchrig.compat.moved_modules`, docs/changelog.md).
"""

from __future__ import annotations

import importlib
import importlib.util
import os as _os
from typing import TYPE_CHECKING, Any

from torchrig._version import __version__
from torchrig.compat.moved_modules import install as _install_moved_modules

# The module paths of 0.1 (torchrig.host.run, torchrig.distributed.process...) stay importable for one release.
_install_moved_modules()

if _os.environ.get("TORCHRIG_PREEMPTION__SIGNALS"):
    # A scheduler's warning that arrives before the Accelerator exists is kept for its first step
    # boundary, not fatal (docs/preemption.md); torch-free, a few signal.signal calls.
    from torchrig.resilience.preemption import install_from_environment as _install_preemption_handlers

    _install_preemption_handlers()

#: Public name -> module that defines it.
_LAZY: dict[str, str] = {
    # the user API
    "Accelerator": "torchrig.accelerator",
    # Accelerate has it only in accelerate.state; scripts reach for it beside PartialState
    "AcceleratorState": "torchrig.distributed.process",
    # plugin API
    "hookimpl": "torchrig.plugin.markers",
    "hookspec": "torchrig.plugin.markers",
    "HOOK_API_VERSION": "torchrig.plugin.hookspecs",
    "PluginManifest": "torchrig.plugin.manifest",
    "PluginHost": "torchrig.host.plugin_host",
    "PluginKind": "torchrig.plugin.kinds",
    "PluginStatus": "torchrig.host.plugin_host",
    "RunContext": "torchrig.host.run",
    "StepPlan": "torchrig.training.step_plan",
    "StepPlanBuilder": "torchrig.training.step_plan",
    "DeviceBackend": "torchrig.distributed.device",
    "Collectives": "torchrig.distributed.collectives",
    "Tracker": "torchrig.plugin.tracker",
    # data types exchanged through hooks
    "Capabilities": "torchrig.plugin.types",
    "CliFlag": "torchrig.plugin.types",
    "ClusterInfo": "torchrig.plugin.types",
    "ConfigProblem": "torchrig.plugin.types",
    "ConfigSection": "torchrig.plugin.types",
    "LaunchPlan": "torchrig.plugin.types",
    "PreparedModel": "torchrig.plugin.types",
    "Stash": "torchrig.plugin.types",
    "StashKey": "torchrig.plugin.types",
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
    from torchrig.distributed.collectives import Collectives
    from torchrig.distributed.device import DeviceBackend
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
    from torchrig.host.plugin_host import PluginHost, PluginStatus
    from torchrig.host.run import RunContext
    from torchrig.plugin.hookspecs import HOOK_API_VERSION
    from torchrig.plugin.kinds import PluginKind
    from torchrig.plugin.manifest import PluginManifest
    from torchrig.plugin.markers import hookimpl, hookspec
    from torchrig.plugin.tracker import Tracker
    from torchrig.plugin.types import (
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
    from torchrig.training.step_plan import StepPlan, StepPlanBuilder
