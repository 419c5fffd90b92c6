"""torchrig's test kit, for torchrig itself and for plugin authors. A stable, documented API.

Everything a plugin distribution needs to prove itself without installing anything else
(docs/plugins.md, "Testing a plugin"):

* plugin hosts and fake distributions — :func:`make_host` (a fresh plugin manager over the
  installed distributions plus fakes), :func:`resolved_config` (the ``ResolvedConfig`` a run built
  by hand takes), :class:`FakeDistribution`, :func:`plugin_distribution`,
  :class:`FakeModules`: discovery tests without installing anything;
* :class:`HookRecorder` / :class:`HookCall` — record the hook calls a host makes and assert their
  order;
* :func:`tiny_run` / :class:`TinyRun` — a tiny in-process training run through the real
  ``Accelerator``;
* contract suites to subclass — :class:`StrategyContract`, :class:`PrecisionContract`,
  :class:`DeviceContract`, :class:`ClusterContract`, :class:`TrackerContract`
  (:mod:`torchrig.testing.contracts`); :func:`rank_environment` sets a rank's variables for a
  task;
* :class:`WorkerPool` (with :class:`WorkerContext`, :class:`WorkerError`, :class:`WorkerDied`,
  :class:`PoolTimeout`) — live ranks already joined in a gloo process group, that tests send
  functions to (a launch costs seconds; a pooled task milliseconds), with hard timeouts;
* effect assertions (:mod:`torchrig.testing.effects`) — proof that a feature changed what ran:
  :func:`assert_forward_dtype` / :func:`record_forward_dtypes` (the dtype the forward's matmuls ran
  in), :func:`assert_master_weights`, :func:`count_collectives` / :func:`assert_collectives` (c10d
  collectives by kind), :func:`count_compilation` / :func:`assert_compiled`,
  :func:`assert_modules_converted`;
* :class:`ProcessGuard`, :func:`leftover_processes`, :func:`spawn_in_new_session` — assert that a
  test leaves no process behind.
* tiny models tests share, one name for one network, imported from their modules:
  :mod:`torchrig.testing.models` (pure torch), :mod:`torchrig.testing.hf_models` (transformers),
  :mod:`torchrig.testing.peft_lora` (the LoRA workload); :func:`torchrig.testing.scripts.load_script`
  imports a script by path instead of putting its folder on ``sys.path``.

The pytest plugin (:mod:`torchrig.testing.pytest_plugin`: fixtures ``gloo_pool``,
``process_guard``, ``fake_modules``; markers ``multiprocess``, ``gpu``, ``slow``) is opt-in: ``-p
torchrig.testing.pytest_plugin`` or ``addopts`` in the plugin's ``pyproject.toml``. Names are
imported lazily so that using the fakes never imports torch.

Stability: the names in ``__all__`` and the documented attributes of the contract classes follow
the hook-API version (:data:`torchrig.HOOK_API_VERSION`); everything else in these modules is
internal.
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
    "WorkerContext": "torchrig.testing.pool_worker",
    "WorkerError": "torchrig.testing.pool",
    "WorkerDied": "torchrig.testing.pool",
    "PoolTimeout": "torchrig.testing.pool",
    "ProcessGuard": "torchrig.testing.processes",
    "leftover_processes": "torchrig.testing.processes",
    "spawn_in_new_session": "torchrig.testing.processes",
    "make_host": "torchrig.testing.hosts",
    "resolved_config": "torchrig.testing.hosts",
    "TinyRun": "torchrig.testing.runs",
    "tiny_run": "torchrig.testing.runs",
    "rank_environment": "torchrig.testing.contracts",
    "StrategyContract": "torchrig.testing.contracts",
    "PrecisionContract": "torchrig.testing.contracts",
    "DeviceContract": "torchrig.testing.contracts",
    "ClusterContract": "torchrig.testing.contracts",
    "TrackerContract": "torchrig.testing.contracts",
    **{name: "torchrig.testing.effects" for name in (
        "CollectiveCounts", "CompileCounts", "ForwardRecord", "assert_collectives", "assert_compiled",
        "assert_forward_dtype", "assert_master_weights", "assert_modules_converted", "count_collectives",
        "count_compilation", "record_forward_dtypes")},
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchrig.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
