"""Accelerate's DeepSpeed helpers that scripts import from ``accelerate.utils`` (exported through the manifest)."""

from __future__ import annotations

from typing import Any

import deepspeed
from torchrig.plugin import AcceleratorState

#: ZeRO-3: gather partitioned parameters for the block (``deepspeed.zero.GatheredParameters`` itself).
GatheredParameters = deepspeed.zero.GatheredParameters


def get_active_deepspeed_plugin(state: Any = None) -> Any:
    """The ``DeepSpeedPlugin`` of the running DeepSpeed run (Accelerate's ``get_active_deepspeed_plugin``).

    torchrig runs one DeepSpeed configuration per run, so the active plugin is the run's. Raises
    ``ValueError`` when the run does not use the deepspeed strategy."""
    state = state if state is not None else AcceleratorState()
    plugin = getattr(state, "deepspeed_plugin", None)
    if plugin is None:
        raise ValueError("get_active_deepspeed_plugin: this run does not use the deepspeed strategy; select it with "
                         "Accelerator(deepspeed_plugin=DeepSpeedPlugin(...)) or `torchrig launch --use_deepspeed`.")
    return plugin


__all__ = ["GatheredParameters", "get_active_deepspeed_plugin"]
