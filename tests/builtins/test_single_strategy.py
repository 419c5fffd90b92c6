"""The core's built-in ``single`` strategy passes the strategy contract
(torchrig.testing.contracts.StrategyContract); each plugin distribution tests its own strategies
under ``plugins/<name>/tests/``."""

from __future__ import annotations

import pytest
from torchrig.testing.contracts import StrategyContract

pytestmark = pytest.mark.multiprocess


class TestSingleStrategy(StrategyContract):
    strategy = "single"
    world_size = 1
