"""torchrig's public plugin API: everything a plugin author imports, from one place.

``from torchrig.plugin import hookimpl, PluginManifest, RunContext, ...`` — a plugin (first-party or
third-party) imports torchrig only through this module (tests/plugin/test_api.py enforces it for
``plugins/*/src`` and ``examples/localsgd/src``); ``torchrig.testing`` is the kit for a plugin's
*tests*. Every name below is documented in docs/plugins.md ("The plugin API") and follows the
hook-API version (:data:`HOOK_API_VERSION`); whatever else lives in the core's modules is internal
and may move without notice.

Names resolve lazily (PEP 562): importing this package imports no torchrig module and no torch,
so a manifest that imports it stays cheap (``torchrig --help``, ``torchrig plugins``); each name
costs its defining module the first time it is used.

The package also holds what a plugin is made of: the hook contract (:mod:`.hookspecs`), its
pluggy markers (:mod:`.markers`), plugin kinds and entry-point groups (:mod:`.kinds`), the
torch-free manifest (:mod:`.manifest`), the tracker interface (:mod:`.tracker`) and the plain
data exchanged through hooks (:mod:`.types`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> ``"module"`` that defines it under that name, or ``"module:attribute"`` when the
#: API gives it a name that says what it is outside its module.
_API: dict[str, str] = {
    # the hook contract and the manifest
    "hookimpl": "torchrig.plugin.markers",
    "hookspec": "torchrig.plugin.markers",
    "HOOK_API_VERSION": "torchrig.plugin.hookspecs",
    "PluginKind": "torchrig.plugin.kinds",
    "PluginManifest": "torchrig.plugin.manifest",
    # data exchanged through hooks
    "Capabilities": "torchrig.plugin.types",
    "CliFlag": "torchrig.plugin.types",
    "ClusterInfo": "torchrig.plugin.types",
    "ConfigProblem": "torchrig.plugin.types",
    "ConfigSection": "torchrig.plugin.types",
    "LaunchPlan": "torchrig.plugin.types",
    "PreparedModel": "torchrig.plugin.types",
    "Stash": "torchrig.plugin.types",
    "StashKey": "torchrig.plugin.types",
    "ACCUMULATION_STATE": "torchrig.plugin.types",
    "AccumulationState": "torchrig.plugin.types",
    # the run a runtime hook receives, and what it builds
    "RunContext": "torchrig.host.run",
    "ResolvedConfig": "torchrig.config.resolved",
    "StepPlan": "torchrig.training.step_plan",
    "StepPlanBuilder": "torchrig.training.step_plan",
    "install_autocast": "torchrig.training.step_plan",
    "install_loss_scaling": "torchrig.training.step_plan",
    "grad_scaler_kwargs": "torchrig.training.step_plan",
    "DeviceBackend": "torchrig.distributed.device",
    "Collectives": "torchrig.distributed.collectives",
    "AcceleratorState": "torchrig.distributed.process",
    "OptimizerStepScheduler": "torchrig.scheduler",
    # declaring and reading configuration
    "option": "torchrig.config.schema",
    "at_least": "torchrig.config.schema",
    "between": "torchrig.config.schema",
    "class_names": "torchrig.config.schema",
    "enum_name": "torchrig.config.schema",
    "suggest": "torchrig.config.schema",
    "KwargsHandler": "torchrig.config.options",
    "CoreOptions": "torchrig.config.options",
    "DataLoaderConfiguration": "torchrig.config.options",
    "ParallelismConfig": "torchrig.config.options",
    "TorchDynamoPlugin": "torchrig.config.options",
    "TP_STYLES": "torchrig.config.options",
    "ConfigLayer": "torchrig.config.sources:Layer",
    "parallelism_key": "torchrig.config.parallelism:key_of",
    "infer_parallelism_sizes": "torchrig.config.parallelism:infer_sizes",
    "ConfigDocument": "torchrig.config.loader:Document",
    "load_config_text": "torchrig.config.loader:load_text",
    # errors
    "ConfigError": "torchrig.errors",
    "PlanningUnsupported": "torchrig.errors",
    "TorchrigError": "torchrig.errors",
    # trackers
    "Tracker": "torchrig.plugin.tracker",
    "LogEvent": "torchrig.plugin.tracker",
    "as_scalar": "torchrig.plugin.tracker",
    "flatten": "torchrig.plugin.tracker",
    "jsonable": "torchrig.plugin.tracker",
    # checkpoints: strategies with their own format, reading the core's
    "PICKLE_OPT_IN": "torchrig.checkpoint.trust",
    "check_loadable": "torchrig.checkpoint.trust",
    "load_pickled": "torchrig.checkpoint.trust",
    "load_model_state": "torchrig.checkpoint.plain",
    "model_files": "torchrig.checkpoint.plain",
    "read_model_state": "torchrig.checkpoint.plain",
    "read_optimizer_state": "torchrig.checkpoint.plain",
    "optimizer_by_name": "torchrig.checkpoint.plain",
    "run_layout": "torchrig.checkpoint.topology:current",
    "saved_layout": "torchrig.checkpoint.topology:saved",
    "describe_layout": "torchrig.checkpoint.topology:describe",
    # memory estimates (torchrig estimate-memory; torch-free)
    "MemoryComponent": "torchrig.estimate.memory",
    "MemoryEstimate": "torchrig.estimate.memory",
    "MemoryRequest": "torchrig.estimate.memory",
    "activation_component": "torchrig.estimate.memory",
    "optimizer_bytes": "torchrig.estimate.memory",
    "replicated_estimate": "torchrig.estimate.memory",
    "sharded_elements": "torchrig.estimate.memory",
    # the worker's status file and logging
    "record_status": "torchrig.resilience.run_status:record",
    "get_logger": "torchrig.logging",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    """Resolve a public name on first use (then cached in the module's globals)."""
    target = _API.get(name)
    if target is None:
        raise AttributeError(f"module 'torchrig.plugin' has no attribute {name!r}: the plugin API is the names in "
                             "torchrig.plugin.__all__ (docs/plugins.md, \"The plugin API\")")
    module, _, attribute = target.partition(":")
    value = getattr(importlib.import_module(module), attribute or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))


if TYPE_CHECKING:  # pragma: no cover
    from torchrig.checkpoint.plain import (
        load_model_state,
        model_files,
        optimizer_by_name,
        read_model_state,
        read_optimizer_state,
    )
    from torchrig.checkpoint.topology import current as run_layout
    from torchrig.checkpoint.topology import describe as describe_layout
    from torchrig.checkpoint.topology import saved as saved_layout
    from torchrig.checkpoint.trust import PICKLE_OPT_IN, check_loadable, load_pickled
    from torchrig.config.loader import Document as ConfigDocument
    from torchrig.config.loader import load_text as load_config_text
    from torchrig.config.options import (
        TP_STYLES,
        CoreOptions,
        DataLoaderConfiguration,
        KwargsHandler,
        ParallelismConfig,
        TorchDynamoPlugin,
    )
    from torchrig.config.parallelism import infer_sizes as infer_parallelism_sizes
    from torchrig.config.parallelism import key_of as parallelism_key
    from torchrig.config.resolved import ResolvedConfig
    from torchrig.config.schema import at_least, between, class_names, enum_name, option, suggest
    from torchrig.config.sources import Layer as ConfigLayer
    from torchrig.distributed.collectives import Collectives
    from torchrig.distributed.device import DeviceBackend
    from torchrig.distributed.process import AcceleratorState
    from torchrig.errors import ConfigError, TorchrigError
    from torchrig.estimate.memory import (
        MemoryComponent,
        MemoryEstimate,
        MemoryRequest,
        activation_component,
        optimizer_bytes,
        replicated_estimate,
        sharded_elements,
    )
    from torchrig.host.run import RunContext
    from torchrig.logging import get_logger
    from torchrig.plugin.hookspecs import HOOK_API_VERSION
    from torchrig.plugin.kinds import PluginKind
    from torchrig.plugin.manifest import PluginManifest
    from torchrig.plugin.markers import hookimpl, hookspec
    from torchrig.plugin.tracker import LogEvent, Tracker, as_scalar, flatten, jsonable
    from torchrig.plugin.types import (
        ACCUMULATION_STATE,
        AccumulationState,
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
    from torchrig.resilience.run_status import record as record_status
    from torchrig.scheduler import OptimizerStepScheduler
    from torchrig.training.step_plan import (
        StepPlan,
        StepPlanBuilder,
        grad_scaler_kwargs,
        install_autocast,
        install_loss_scaling,
    )
