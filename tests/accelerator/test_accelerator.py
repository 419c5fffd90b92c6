"""The Accelerator on one process, against hand-written PyTorch."""

from __future__ import annotations

import os

import pytest
import torch
import torchrig.accelerator.accelerator as accelerator_module
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchrig import Accelerator, AutocastKwargs, GradientAccumulationPlugin
from torchrig.host.plugin_host import PluginHost
from torchrig.testing import HookRecorder
from torchrig.utils import find_executable_batch_size, set_seed


@pytest.fixture(autouse=True)
def clean_config(monkeypatch, tmp_path):
    """No machine default file or TORCHRIG_* variable from the developer's machine."""
    for key in [k for k in os.environ if k.startswith("TORCHRIG_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path / "torchrig-home"))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def dataset(n: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=generator), torch.randint(0, 4, (n,), generator=generator))


def test_exact_hook_order_of_a_tiny_run_and_no_hooks_per_step(monkeypatch):
    recorders = []

    def recorded_host(*args, **kwargs):
        host = PluginHost(*args, **kwargs)
        recorders.append(HookRecorder(host).start())
        return host

    monkeypatch.setattr(accelerator_module, "PluginHost", recorded_host)
    accelerator = Accelerator(cpu=True)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    loader = DataLoader(dataset(16), batch_size=8)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    (rec,) = recorders
    names = [n for n in rec.names if n not in ("torchrig_config_sections", "torchrig_cli_flags", "torchrig_validate_config")]
    assert names == [
        "torchrig_detect_cluster",
        "torchrig_select_device",
        "torchrig_init_process_group",
        "torchrig_collectives",
        "torchrig_configure",
        "torchrig_strategy_capabilities",
        "torchrig_precision_step_plan",
        "torchrig_convert_model",
        "torchrig_prepare_model",
        "torchrig_prepare_scheduler",
        "torchrig_prepare_dataloader",
    ]
    rec.clear()
    for x, y in loader:
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    assert rec.calls == []  # the step path runs plain callables, never a hook
    accelerator.end_training()
    accelerator.end_training()
    assert rec.names == ["torchrig_unconfigure"]  # the run ends once


def hand_written(steps_data, lr=0.05):
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    for x, y in steps_data:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model


def test_fp32_training_is_bit_identical_to_a_hand_written_loop():
    data = dataset(64)
    reference = hand_written([(x, y) for x, y in DataLoader(data, batch_size=8)])
    accelerator = Accelerator(cpu=True)
    model = mlp()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05),
                                                   DataLoader(data, batch_size=8))
    for x, y in loader:
        optimizer.zero_grad()
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
    for a, b in zip(reference.parameters(), accelerator.unwrap_model(model).parameters()):
        assert torch.equal(a, b)


def test_bf16_trains_close_to_fp32():
    data = dataset(64)
    reference = hand_written([(x, y) for x, y in DataLoader(data, batch_size=8)])
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model = mlp()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05),
                                                   DataLoader(data, batch_size=8))
    for x, y in loader:
        out = model(x)
        assert out.dtype == torch.float32  # forward autocast, outputs returned in fp32
        accelerator.backward(nn.functional.cross_entropy(out, y))
        optimizer.step()
        optimizer.zero_grad()
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=0.05), (a - b).abs().max()
    with accelerator.autocast():
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with accelerator.autocast(AutocastKwargs(enabled=False)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert accelerator.unwrap_model(model, keep_fp32_wrapper=False)(torch.ones(1, 8)).dtype == torch.float32


def test_fp16_overflow_skips_the_step_and_the_scheduler():
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(torch.randn(4, 8)).sum() * float("inf")
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    assert accelerator.optimizer_step_was_skipped
    assert scheduler.get_last_lr() == [0.1]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    optimizer.zero_grad()
    accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscales first
    assert torch.isfinite(norm)
    optimizer.step()
    scheduler.step()
    assert not accelerator.optimizer_step_was_skipped
    assert scheduler.get_last_lr() == [0.05]


def test_accumulating_4_micro_batches_of_8_equals_one_batch_of_32():
    data = dataset(32)
    x, y = data.tensors
    reference = mlp()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.cross_entropy(reference(x), y).backward()
    ref_optimizer.step()

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = mlp()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                   DataLoader(data, batch_size=8))
    syncs = []
    for bx, by in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.cross_entropy(model(bx), by))  # divided by 4 here, once
            syncs.append(accelerator.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
    assert syncs == [False, False, False, True]
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)



def test_gradient_accumulation_steps_set_after_construction_takes_effect():
    """Accelerate's automatic_gradient_accumulation example assigns ``accelerator.gradient_accumulation_steps``
    after building the Accelerator; the new count decides the syncs and the loss scaling."""
    accelerator = Accelerator(cpu=True)
    accelerator.gradient_accumulation_steps = 2
    model = mlp()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                   DataLoader(dataset(32), batch_size=8))
    syncs = []
    for bx, by in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.cross_entropy(model(bx), by))
            syncs.append(accelerator.sync_gradients)
            optimizer.step()
            optimizer.zero_grad()
    assert accelerator.gradient_accumulation_steps == 2 and syncs == [False, True, False, True]
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="gradient_accumulation_steps must be a positive int"):
            accelerator.gradient_accumulation_steps = bad

def test_scheduler_steps_once_per_optimizer_step_and_end_of_dataloader_syncs():
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=3))
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    # 10 batches: syncs at micro-steps 3, 6, 9 and at the end of the dataloader (10).
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler,
                                                              DataLoader(dataset(40), batch_size=4))
    steps = 0
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            steps += accelerator.sync_gradients
    assert steps == 4
    assert scheduler.scheduler.last_epoch == 4  # never multiplied by anything


def test_gather_for_metrics_counts_every_sample_once_on_uneven_batches():
    accelerator = Accelerator(cpu=True)
    loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
    seen = [accelerator.gather_for_metrics(batch[0]) for batch in loader]
    assert torch.equal(torch.cat(seen), torch.arange(10))
    assert accelerator.gather_for_metrics({"a": torch.ones(2)})["a"].shape == (2,)
    assert accelerator.gather_for_metrics(["x"], use_gather_object=True) == ["x"]


def test_single_process_collectives_and_helpers():
    accelerator = Accelerator(cpu=True)
    t = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(accelerator.gather(t), t)
    assert torch.equal(accelerator.reduce(t, "sum", scale=2.0), t * 2)
    assert torch.equal(accelerator.pad_across_processes(t, dim=1), t)
    accelerator.wait_for_everyone()
    with accelerator.split_between_processes([1, 2, 3]) as share:
        assert share == [1, 2, 3]
    with accelerator.main_process_first():
        pass
    assert accelerator.on_main_process(lambda: 7)() == 7
    assert accelerator.on_process(lambda: 7, process_index=1)() is None
    assert not accelerator.check_trigger()
    accelerator.set_trigger()
    assert accelerator.check_trigger() and not accelerator.check_trigger()
    assert accelerator.is_main_process and accelerator.is_local_main_process and accelerator.is_last_process
    assert accelerator.num_processes == 1 and accelerator.process_index == 0
    assert accelerator.device == torch.device("cpu")


def test_unwrap_get_state_dict_and_free_memory():
    accelerator = Accelerator(cpu=True)
    original = mlp()
    model = accelerator.prepare(original)
    assert accelerator.unwrap_model(model) is original
    assert set(accelerator.get_state_dict(model)) == set(original.state_dict())
    assert accelerator.free_memory(model) == [None]
    assert accelerator._models == []


def test_two_accelerators_share_a_process_and_a_different_strategy_raises(fake_modules):
    first = Accelerator(cpu=True, mixed_precision="bf16")
    second = Accelerator(cpu=True)  # same strategy, different precision: fine
    assert (first.mixed_precision, second.mixed_precision) == ("bf16", "no")
    model_a, _ = first.prepare(mlp()), second.prepare(mlp())
    assert model_a(torch.ones(1, 8)).dtype == torch.float32


def test_find_executable_batch_size_halves_on_out_of_memory():
    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 16:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")
        return batch_size

    assert train() == 16 and tried == [64, 32, 16]

    @find_executable_batch_size(starting_batch_size=4)
    def broken(batch_size):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken()


def test_set_seed_makes_runs_repeatable():
    set_seed(3)
    a = torch.rand(3)
    set_seed(3)
    assert torch.equal(a, torch.rand(3))


def test_get_logger_logs_on_the_main_process(caplog):
    from torchrig.logging import get_logger

    logger = get_logger("torchrig.test", log_level="INFO")
    with caplog.at_level("INFO"):
        logger.info("hello main")
        logger.info("every rank", main_process_only=False)
    assert "hello main" in caplog.text and "every rank" in caplog.text


def test_prepare_rejects_an_optimizer_spanning_two_models():
    accelerator = Accelerator(cpu=True)
    a, b = mlp(), mlp()
    optimizer = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    with pytest.raises(ValueError, match="holds parameters of Sequential and others that are not its"):
        accelerator.prepare(a, b, optimizer)


def test_torch_compile_after_wrapping():
    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    original = mlp()
    model = accelerator.prepare(original)
    assert model is not original and accelerator.unwrap_model(model) is original
    assert torch.allclose(model(torch.ones(2, 8)), original(torch.ones(2, 8)))


def test_shuffled_training_is_bit_identical_to_a_hand_written_loop_with_the_same_generator_seed():
    from torch.utils.data import RandomSampler
    from torchrig import DataLoaderConfiguration

    data, seed, epochs = dataset(48), 1234, 2
    reference = mlp()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for epoch in range(epochs):  # the data layer's rule: epoch e shuffles with Generator(seed + e)
        sampler = RandomSampler(data, generator=torch.Generator().manual_seed(seed + epoch))
        for x, y in DataLoader(data, batch_size=8, sampler=sampler):
            ref_optimizer.zero_grad()
            nn.functional.cross_entropy(reference(x), y).backward()
            ref_optimizer.step()

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(data_seed=seed))
    model = mlp()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05),
                                                   DataLoader(data, batch_size=8, shuffle=True))
    rng_before = torch.get_rng_state()
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
    assert torch.equal(rng_before, torch.get_rng_state())  # iterating drew nothing from the global RNG
    for a, b in zip(reference.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_a_second_strategy_on_the_same_world_raises():
    from torchrig.estimate.fake_world import fake_world
    from torchrig.host.run import RunContext
    from torchrig.host.runtime import claim_world
    from torchrig.testing import make_host, resolved_config

    host = make_host()
    with fake_world(2, 0, local_world_size=2):  # a world group to share (torch's fake one: no process)
        first = RunContext(config=resolved_config({"strategy": "single"}, host=host))
        claim_world(first)
        with pytest.raises(RuntimeError, match="already runs an Accelerator with strategy 'single'"):
            claim_world(RunContext(config=resolved_config({"strategy": "ddp"}, host=host)))
        del first
        claim_world(RunContext(config=resolved_config({"strategy": "ddp"}, host=host)))  # the first run ended: the world is free
    # one process without a group shares nothing: two strategies side by side
    claim_world(RunContext(config=resolved_config({"strategy": "single"}, host=host)))
    claim_world(RunContext(config=resolved_config({"strategy": "ddp"}, host=host)))


def test_regional_compilation_compiles_each_repeated_block():
    from torchrig import TorchDynamoPlugin

    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=True))
    original = Blocks()
    expected = original(torch.ones(2, 4))
    model = accelerator.prepare(original)
    assert all(type(layer).__name__ == "OptimizedModule" for layer in model.layers)
    assert torch.allclose(model(torch.ones(2, 4)), expected)


def test_grad_scaler_kwargs_and_autocast_kwargs_reach_the_precision_plugin():
    from torchrig import GradScalerKwargs

    accelerator = Accelerator(cpu=True, mixed_precision="fp16",
                              kwargs_handlers=[GradScalerKwargs(init_scale=128.0, growth_interval=1),
                                               AutocastKwargs(enabled=False)])
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    assert model(torch.ones(1, 8)).dtype == torch.float32  # autocast disabled by AutocastKwargs
    precision = accelerator._host.pm.get_plugin("precision:fp16")
    assert precision.scaler.get_scale() == 128.0
    accelerator.backward(model(torch.ones(2, 8)).pow(2).mean())
    optimizer.step()
    assert precision.scaler.get_scale() == 256.0  # grew after growth_interval=1 good step


def test_grad_scaler_kwargs_without_a_grad_scaler_say_they_have_no_effect():
    """Under bf16 (and fp32) no GradScaler exists: GradScalerKwargs were accepted and ignored without a word."""
    import warnings

    from torchrig import GradScalerKwargs
    from torchrig.errors import NoEffectWarning

    for precision in ("bf16", "no"):
        accelerator = Accelerator(cpu=True, mixed_precision=precision, kwargs_handlers=[GradScalerKwargs(init_scale=8.0)])
        model = mlp()
        with pytest.warns(NoEffectWarning, match=r"grad_scaler_kwargs \(argument Accelerator\(grad_scaler_kwargs=\.\.\.\)\) "
                          rf"has no effect: no GradScaler scales the loss in this run \(mixed_precision {precision!r}"):
            accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    for kwargs in ({"mixed_precision": "fp16", "kwargs_handlers": [GradScalerKwargs(init_scale=8.0)]},
                   {"mixed_precision": "bf16"}):  # a scaler that uses them, or nothing set: no warning
        accelerator = Accelerator(cpu=True, **kwargs)
        model = mlp()
        with warnings.catch_warnings():
            warnings.simplefilter("error", NoEffectWarning)
            accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_scheduler_stepped_on_every_call_when_asked():
    from torchrig import GradientAccumulationPlugin

    for kwargs in ({"step_scheduler_with_optimizer": False},
                   {"gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=2, adjust_scheduler=False)}):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2 if "step_scheduler_with_optimizer" in kwargs else 1,
                                  **kwargs)
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        for _ in range(4):
            with accelerator.accumulate(model):
                accelerator.backward(model(torch.ones(2, 8)).sum())
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        assert scheduler.scheduler.last_epoch == 4, kwargs


def test_device_placement_false_leaves_batches_alone_and_gradient_accumulation_kwargs():
    from torchrig import DataLoaderConfiguration
    from torchrig.errors import ConfigError

    accelerator = Accelerator(cpu=True, device_placement=False)
    loader = accelerator.prepare(DataLoader(dataset(8), batch_size=4))
    assert len(list(loader)) == 2
    configured = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        gradient_accumulation_kwargs={"num_steps": 3, "sync_each_batch": True}))
    assert configured.gradient_accumulation_steps == 3 and configured.gradient_state.sync_each_batch
    with pytest.raises(ConfigError, match="gradient_accumulation_kwargs.num_step"):
        Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(gradient_accumulation_kwargs={"num_step": 3}))


def test_autocast_handler_disables_inside_the_models_autocast_and_sets_the_cache():
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    with accelerator.autocast():
        with accelerator.autocast(AutocastKwargs(enabled=False)):
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with accelerator.autocast(AutocastKwargs(cache_enabled=False)):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
