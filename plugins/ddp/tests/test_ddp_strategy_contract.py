"""The ddp strategy (torchrig-ddp) passes the strategy contract (torchrig.testing.contracts.StrategyContract)."""

from __future__ import annotations

import pytest
from torchrig.testing.contracts import StrategyContract

pytestmark = pytest.mark.multiprocess


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
