"""First-party strategies pass the strategy contract (torchrig.testing.contracts.StrategyContract)."""

from __future__ import annotations

import pytest
from torchrig.testing.contracts import StrategyContract

pytestmark = pytest.mark.multiprocess


class TestSingleStrategy(StrategyContract):
    strategy = "single"
    world_size = 1


class TestDDPStrategy(StrategyContract):
    strategy = "ddp"
    world_size = 2
    invalid_configs = [({"ddp_config": {"comm_hook": "fp16", "comm_wrapper": "fp16"}}, "ddp_config.comm_wrapper")]


class TestDDPStrategyBF16(StrategyContract):
    """The precision plugin applies unchanged under DDP."""

    strategy = "ddp"
    world_size = 2
    options = {"mixed_precision": "bf16"}
    atol = 5e-2


class TestFSDPStrategy(StrategyContract):
    """FSDP2 (fully_shard) on two gloo ranks: sharded parameters, DCP checkpoint state."""

    strategy = "fsdp"
    world_size = 2
    invalid_configs = [({"use_cpu": True, "fsdp_config": {"cpu_offload": True}}, "fsdp_config.cpu_offload")]


class TestFSDPStrategyBF16(StrategyContract):
    """bf16 through FSDP2's MixedPrecisionPolicy (the strategy owns precision)."""

    strategy = "fsdp"
    world_size = 2
    options = {"mixed_precision": "bf16"}
    atol = 5e-2


def _deepspeed(**fields):
    from torchrig_deepspeed.options import DeepSpeedPlugin

    return {"deepspeed_plugin": DeepSpeedPlugin(**fields)}


class TestDeepSpeedStrategyZeRO2(StrategyContract):
    """DeepSpeed ZeRO-2 engines: the engine owns backward, step, accumulation, clipping, checkpoints."""

    strategy = "deepspeed"
    world_size = 2
    options = _deepspeed(zero_stage=2)
    invalid_configs = [({"use_cpu": True, "mixed_precision": "fp16"}, "DeepSpeed's fp16 needs a CUDA GPU")]


class TestDeepSpeedStrategyZeRO0(StrategyContract):
    """DeepSpeed without ZeRO (stage 0): plain data parallelism inside the engine."""

    strategy = "deepspeed"
    world_size = 2
    options = _deepspeed(zero_stage=0)
