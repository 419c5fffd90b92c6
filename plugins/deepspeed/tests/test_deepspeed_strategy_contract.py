"""The deepspeed strategy (torchrig-deepspeed) passes the strategy contract (torchrig.testing.contracts.StrategyContract)."""

from __future__ import annotations

import pytest
from torchrig.testing.contracts import StrategyContract
from torchrig_deepspeed.options import DeepSpeedPlugin

pytestmark = pytest.mark.multiprocess


def _deepspeed(**fields):
    return {"deepspeed_plugin": DeepSpeedPlugin(**fields)}


class TestDeepSpeedStrategyZeRO2(StrategyContract):
    """DeepSpeed ZeRO-2 engines: the engine owns backward, step, accumulation, clipping, checkpoints."""

    strategy = "deepspeed"
    world_size = 2
    options = _deepspeed(zero_stage=2)
    reduces_on_micro_steps = True  # ZeRO-2 reduces each micro-step's gradients into their partitions
    invalid_configs = [({"use_cpu": True, "mixed_precision": "fp16"}, "DeepSpeed's fp16 needs a CUDA GPU")]


class TestDeepSpeedStrategyZeRO0(StrategyContract):
    """DeepSpeed without ZeRO (stage 0): plain data parallelism inside the engine."""

    strategy = "deepspeed"
    world_size = 2
    options = _deepspeed(zero_stage=0)
