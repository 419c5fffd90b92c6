"""Accelerate's DeepSpeed helper names, resolved through the deepspeed plugin's manifest exports."""

from __future__ import annotations

import deepspeed
import pytest
from torchrig.testing.contracts import rank_environment

pytestmark = pytest.mark.multiprocess


def test_gathered_parameters_is_deepspeeds_own():
    from torchrig.utils import GatheredParameters

    assert GatheredParameters is deepspeed.zero.GatheredParameters


def _active_plugin(ctx):
    import torch
    from torchrig import Accelerator
    from torchrig.utils import DeepSpeedPlugin, get_active_deepspeed_plugin

    with rank_environment(ctx.rank, ctx.world_size):
        plugin = DeepSpeedPlugin(zero_stage=2)
        accelerator = Accelerator(cpu=True, deepspeed_plugin=plugin)
        model = torch.nn.Linear(4, 2)
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # a real engine on gloo
        active = get_active_deepspeed_plugin(accelerator.state)
        accelerator.end_training()
        return active is accelerator.state.deepspeed_plugin, active.zero_stage


def test_active_plugin_is_the_runs_and_refused_without_deepspeed(gloo_pool):
    for same, stage in gloo_pool.run(_active_plugin, timeout=120):
        assert same and stage == 2
    from torchrig import Accelerator
    from torchrig.utils import get_active_deepspeed_plugin

    accelerator = Accelerator(cpu=True)
    with pytest.raises(ValueError, match="does not use the deepspeed strategy"):
        get_active_deepspeed_plugin(accelerator.state)
    accelerator.end_training()
