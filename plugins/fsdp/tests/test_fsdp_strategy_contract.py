"""The fsdp strategy (torchrig-fsdp, FSDP2) passes the strategy contract (torchrig.testing.contracts.StrategyContract)."""

from __future__ import annotations

import pytest
from torchrig.testing.contracts import StrategyContract

pytestmark = pytest.mark.multiprocess


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


class TestFSDPStrategyMesh(StrategyContract):
    """An explicit mesh from parallelism_config: 2 replicas x 1 shard (HSDP layout, fully_shard over a 2-D mesh)."""

    strategy = "fsdp"
    world_size = 2
    options = {"parallelism_config": {"dp_replicate_size": 2}}
    invalid_configs = [({"parallelism_config": {"dp_shard_size": -1, "tp_size": -1}}, "parallelism_config.tp_size")]
