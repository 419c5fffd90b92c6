"""torchrig's test kit, for torchrig itself and for plugin authors.

* :class:`FakeDistribution`, :func:`plugin_distribution`, :class:`FakeModules` — discovery
  tests without installing anything;
* :class:`HookRecorder` — record hook calls and assert their order;
* :class:`WorkerPool` — live ranks already joined in a gloo process group, that tests send
  functions to (a launch costs seconds; a pooled task milliseconds), with hard timeouts;
* :class:`ProcessGuard` — assert that a test leaves no process behind.

The pytest plugin (:mod:`torchrig.testing.pytest_plugin`) is opt-in: ``-p
torchrig.testing.pytest_plugin`` or ``pytest_plugins = ["torchrig.testing.pytest_plugin"]``.
Names are imported lazily so that using the fakes never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "FakeDistribution": "torchrig.testing.fakes",
    "FakeModules": "torchrig.testing.fakes",
    "plugin_distribution": "torchrig.testing.fakes",
    "HookCall": "torchrig.testing.recorder",
    "HookRecorder": "torchrig.testing.recorder",
    "WorkerPool": "torchrig.testing.pool",
    "WorkerContext": "torchrig.testing.pool",
    "WorkerError": "torchrig.testing.pool",
    "WorkerDied": "torchrig.testing.pool",
    "PoolTimeout": "torchrig.testing.pool",
    "ProcessGuard": "torchrig.testing.processes",
    "leftover_processes": "torchrig.testing.processes",
    "make_host": "torchrig.testing.hosts",
    "StrategyContract": "torchrig.testing.contracts",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchrig.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
