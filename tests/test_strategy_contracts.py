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


class TestFSDPStrategyBF16(StrategyContract):
    """bf16 through FSDP2's MixedPrecisionPolicy (the strategy owns precision)."""

    strategy = "fsdp"
    world_size = 2
    options = {"mixed_precision": "bf16"}
    atol = 5e-2
