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


# -- DummyOptim / DummyScheduler and deepspeed_config ---------------------------------------------------------

PLACEHOLDER_CONFIG = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 2},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
}


def _train_with_placeholders(ctx):
    import torch
    from torchrig import Accelerator
    from torchrig.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    with rank_environment(ctx.rank, ctx.world_size):
        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=PLACEHOLDER_CONFIG))
        config = accelerator.state.deepspeed_plugin.deepspeed_config
        before = {"optimizer" in config, "scheduler" in config, config["optimizer"]["params"]["lr"]}
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        groups = [{"params": model[0].parameters(), "weight_decay": 0.1},
                  {"params": model[1].parameters(), "weight_decay": 0.0}]
        optimizer = DummyOptim(groups, lr=0.01)
        scheduler = DummyScheduler(optimizer, total_num_steps=20, warmup_num_steps=4)
        data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 2)),
                                           batch_size=4)
        model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
        engine_scheduler = accelerator.state.deepspeed_plugin.deepspeed_config["scheduler"]["params"]
        lrs = []
        for x, y in data:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
        result = {
            "before": before,
            "same_dict": config is accelerator.state.deepspeed_plugin.deepspeed_config,
            "filled_lr": config["optimizer"]["params"]["lr"],
            "micro_batch": config["train_micro_batch_size_per_gpu"],
            "scheduler_params": dict(engine_scheduler),
            "optimizer_type": type(optimizer.optimizer).__name__,
            "decays": [g["weight_decay"] for g in optimizer.optimizer.param_groups],
            "lrs": lrs,
            "engine_scheduler_type": type(model.lr_scheduler).__name__,
        }
        accelerator.end_training()
        return result


def test_placeholders_stand_for_what_the_json_builds_and_fill_its_auto_values(gloo_pool):
    """DummyOptim/DummyScheduler (deepspeed_with_config_support.py's pattern): DeepSpeed builds the JSON's AdamW
    and WarmupDecayLR; lr/weight decay come from the DummyOptim, warmup from the DummyScheduler, the total divided
    by the number of processes (Accelerate's rule); the engine steps the scheduler (the script's scheduler.step()
    adds nothing: warmup over 4 applied steps, then decay); deepspeed_config is one dict, "auto" before prepare and
    filled after."""
    for result in gloo_pool.run(_train_with_placeholders, timeout=180):
        assert result["before"] == {True, "auto"}
        assert result["same_dict"] and result["filled_lr"] == 0.01 and result["micro_batch"] == 4
        assert result["scheduler_params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4,
                                              "total_num_steps": 10}
        assert result["optimizer_type"] == "AdamW" and result["engine_scheduler_type"] == "WarmupDecayLR"
        assert result["decays"] == [0.1, 0.0]
        lrs = result["lrs"]
        assert len(lrs) == 8  # 64 samples / 2 ranks / batch 4
        assert lrs[0] < lrs[1] < lrs[2] < lrs[3] == pytest.approx(0.01)  # warmup: one scheduler step per step
        assert lrs[4] > lrs[5] > lrs[6] > lrs[7] > 0  # linear decay towards total_num_steps=10


def _placeholder_errors(ctx):
    import torch
    from torchrig import Accelerator
    from torchrig.errors import ConfigError
    from torchrig.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler

    messages = {}
    with rank_environment(ctx.rank, ctx.world_size):
        for case, config, make in (
            ("optim_without_block", {"zero_optimization": {"stage": 1}},
             lambda m: (DummyOptim(m.parameters(), lr=0.1),)),
            ("scheduler_without_block", {"optimizer": {"type": "SGD", "params": {"lr": "auto"}}},
             lambda m: (o := DummyOptim(m.parameters(), lr=0.1), DummyScheduler(o))),
            ("two_schedulers", PLACEHOLDER_CONFIG,
             lambda m: (o := DummyOptim(m.parameters(), lr=0.1),
                        DummyScheduler(o, 10, 1, lr_scheduler_callable=lambda opt: None))),
        ):
            accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
            model = torch.nn.Linear(4, 2)
            try:
                accelerator.prepare(model, *make(model))
            except ConfigError as exc:
                messages[case] = str(exc)
            accelerator.end_training()

        # lr_scheduler_callable builds the scheduler when the JSON has no 'scheduler' block
        accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(
            hf_ds_config={"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}))
        model = torch.nn.Linear(4, 2)
        optimizer = DummyOptim(model.parameters(), lr=0.5)
        scheduler = DummyScheduler(optimizer, lr_scheduler_callable=lambda opt: torch.optim.lr_scheduler.StepLR(
            opt, step_size=1, gamma=0.5))
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        lrs = []
        for _ in range(3):
            accelerator.backward(model(torch.ones(2, 4)).sum())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            lrs.append(scheduler.get_last_lr()[0])
        messages["callable_lrs"] = lrs
        accelerator.end_training()
    return messages


def test_placeholders_without_their_block_are_refused_and_a_callable_builds_the_scheduler(gloo_pool):
    for messages in gloo_pool.run(_placeholder_errors, timeout=180):
        assert "DummyOptim" in messages["optim_without_block"] and "no 'optimizer' block" in messages[
            "optim_without_block"]
        assert "DummyScheduler" in messages["scheduler_without_block"] and "lr_scheduler_callable" in messages[
            "scheduler_without_block"]
        assert "lr_scheduler_callable would build another" in messages["two_schedulers"]
        assert messages["callable_lrs"] == [0.25, 0.125, 0.0625]


def test_placeholders_outside_deepspeed_say_why_they_cannot_step():
    import torch
    from torchrig import Accelerator
    from torchrig.utils import DummyOptim, DummyScheduler

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    optimizer = DummyOptim(model.parameters(), lr=0.1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, DummyScheduler(optimizer))
    accelerator.backward(model(torch.ones(1, 4)).sum())
    with pytest.raises(RuntimeError, match="DummyOptim stands for the optimizer that the DeepSpeed config builds"):
        optimizer.step()
    with pytest.raises(RuntimeError, match="only be prepared under the deepspeed strategy"):
        scheduler.step()
    accelerator.end_training()


def test_deepspeed_config_without_a_json_says_what_the_fields_say():
    from torchrig.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin(zero_stage=3, offload_param_device="cpu", gradient_clipping=1.0)
    config = plugin.deepspeed_config
    assert config is plugin.deepspeed_config
    assert "optimizer" not in config and "scheduler" not in config
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert config["gradient_clipping"] == 1.0 and config["train_batch_size"] == "auto"
