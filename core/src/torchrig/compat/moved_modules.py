"""Module paths that moved in 0.2 (issue 35: concept packages), kept importable for one release.

``import torchrig.run`` still works and is the same module object as ``torchrig.host.run``, with a
:class:`DeprecationWarning` naming the new path; docs/changelog.md lists every move. A meta-path
finder rather than a file per old path: the old paths would otherwise refill the top level the move
emptied. Remove this module (and its installation in ``torchrig/__init__.py``) in 0.3.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

#: old module path -> its home since 0.2
MOVED_MODULES: dict[str, str] = {
    "torchrig.accelerator_arguments": "torchrig.accelerator.arguments",
    "torchrig.accelerator_checkpoints": "torchrig.accelerator.checkpoints",
    "torchrig.accelerator_collectives": "torchrig.accelerator.collectives",
    "torchrig.accelerator_preemption": "torchrig.accelerator.preemption",
    "torchrig.accelerator_tracking": "torchrig.accelerator.tracking",
    "torchrig.context_parallel": "torchrig.accelerator.context_parallel",
    "torchrig.profiling": "torchrig.accelerator.profiling",
    "torchrig.step_contexts": "torchrig.accelerator.step_contexts",
    "torchrig.tracker": "torchrig.plugin.tracker",
    "torchrig.tracker_lane": "torchrig.tracking.lane",
    "torchrig.tracker_helpers": "torchrig.tracking.helpers",
    "torchrig.throughput": "torchrig.tracking.throughput",
    "torchrig.plugin_host": "torchrig.host.plugin_host",
    "torchrig.discovery": "torchrig.host.discovery",
    "torchrig.run": "torchrig.host.run",
    "torchrig.runtime": "torchrig.host.runtime",
    "torchrig.hookspecs": "torchrig.plugin.hookspecs",
    "torchrig.markers": "torchrig.plugin.markers",
    "torchrig.manifest": "torchrig.plugin.manifest",
    "torchrig.kinds": "torchrig.plugin.kinds",
    "torchrig.types": "torchrig.plugin.types",
    "torchrig.process": "torchrig.distributed.process",
    "torchrig.process_group": "torchrig.distributed.process_group",
    "torchrig.collectives": "torchrig.distributed.collectives",
    "torchrig.nested": "torchrig.distributed.nested",
    "torchrig.device": "torchrig.distributed.device",
    "torchrig.enums": "torchrig.compat.enums",
    "torchrig.gradient_state": "torchrig.training.gradient_state",
    "torchrig.step_plan": "torchrig.training.step_plan",
    "torchrig.compile": "torchrig.training.compile",
    "torchrig.compile_check": "torchrig.training.compile_check",
    "torchrig.conversion": "torchrig.training.conversion",
    "torchrig.unprepared": "torchrig.training.unprepared",
    "torchrig.meta_device": "torchrig.training.meta_device",
    "torchrig.memory": "torchrig.estimate.memory",
    "torchrig.memory_model": "torchrig.estimate.memory_model",
    "torchrig.preemption": "torchrig.resilience.preemption",
    "torchrig.preemption_watch": "torchrig.resilience.preemption_watch",
    "torchrig.liveness": "torchrig.resilience.liveness",
    "torchrig.run_status": "torchrig.resilience.run_status",
    "torchrig.selftest": "torchrig.cli.selftest",
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old path as the module at its new path: one module object, two names."""

    def __init__(self, new_name: str) -> None:
        self._new_name = new_name
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} moved to {self._new_name}; the old path goes in torchrig 0.3 "
                      "(docs/changelog.md)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self._new_name)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new path is already executed; only its own ``__spec__`` (which the import
        system just replaced with the old path's) is put back."""
        module.__spec__ = self._spec


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Answers only for the old paths in :data:`MOVED_MODULES`; every other import goes on as usual."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new_name = MOVED_MODULES.get(fullname)
        if new_name is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new_name))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import torchrig`` calls this)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
