"""Contract suites: the behaviour every plugin of a kind must show, as tests to inherit.

A plugin author subclasses the contract of the plugin's kind in their own test module, sets the
plugin's name (and what the contract needs to know), and pytest runs the inherited tests against
the installed plugin through torchrig's real code paths:

==================== ====================================== ============================================
contract             subclass sets                          needs
==================== ====================================== ============================================
StrategyContract     ``strategy``, ``world_size``,          the ``gloo_pool`` fixture for 2 ranks
                     ``options``, ``invalid_configs``
PrecisionContract    ``precision``, ``autocast_dtype``,     one process
                     ``scales_loss``, ``checkpoint_files``
DeviceContract       ``device``, ``device_type``,           one process; hardware tests skip without it
                     ``priority``
ClusterContract      ``cluster``, ``priority``,             nothing: recorded environments
                     ``environments``, ``malformed``
TrackerContract      ``tracker``, ``environment``,          one process
                     ``init_kwargs``, ``read_back()``
==================== ====================================== ============================================

Fixtures come from the opt-in pytest plugin: ``-p torchrig.testing.pytest_plugin`` (or
``addopts`` in the plugin's ``pyproject.toml``). See docs/plugins.md, "Testing a plugin".

The suites import torch and the Accelerator inside the tests and tasks, not at the top: collecting
a plugin's tests stays cheap and torch-free (testing is the top layer: no import here dodges a cycle).
"""

from __future__ import annotations

from torchrig.testing.contracts._common import rank_environment
from torchrig.testing.contracts.cluster import ClusterContract
from torchrig.testing.contracts.device import DeviceContract
from torchrig.testing.contracts.precision import PrecisionContract
from torchrig.testing.contracts.strategy import (
    StrategyContract,
    task_accumulate,
    task_clip,
    task_prepare,
    task_reference,
    task_save_load,
    task_step,
    validate_config,
)
from torchrig.testing.contracts.tracker import TrackerContract

__all__ = [
    "ClusterContract",
    "DeviceContract",
    "PrecisionContract",
    "StrategyContract",
    "TrackerContract",
    "rank_environment",
    "task_accumulate",
    "task_clip",
    "task_prepare",
    "task_reference",
    "task_save_load",
    "task_step",
    "validate_config",
]
