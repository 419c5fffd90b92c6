"""The GPU tier on one CUDA device (marked ``gpu``: skipped cleanly without one).

The CPU tiers run every test with ``cpu=True``; these run the same paths where an Accelerator
picks the GPU by itself: the cuda device plugin, batches moved by the prepared loader (pinned,
non-blocking), autocast and the GradScaler on cuda, the cuda RNG in checkpoints, and inductor
generating GPU kernels. The multi-GPU launches (DDP over NCCL, FSDP2, DeepSpeed) are in
tests/launch/test_launch.py and the plugins' tests; they use every visible GPU, up to two."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchrig import Accelerator, DataLoaderConfiguration
from torchrig.config.options import TorchDynamoPlugin
from torchrig.testing.effects import assert_compiled, assert_master_weights, count_compilation, record_forward_dtypes

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def clean_config(monkeypatch, tmp_path):
    """No machine default file or TORCHRIG_* variable from the developer's machine."""
    for key in [k for k in os.environ if k.startswith("TORCHRIG_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path / "torchrig-home"))


def mlp(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 4))


def dataset(n: int = 64) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=generator), torch.randint(0, 4, (n,), generator=generator))


def train(accelerator: Accelerator, model: nn.Module, optimizer, batches, steps: int | None = None,
          scheduler=None) -> list[float]:
    """``steps`` steps (all, when None) on ``batches`` (a loader, or an iterator to go on with)."""
    losses = []
    for x, y in itertools.islice(batches, steps):
        loss = nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_accelerator_picks_the_gpu_and_matches_a_hand_written_cuda_loop():
    data = dataset(64)
    reference = mlp().cuda()
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for x, y in DataLoader(data, batch_size=8):
        ref_optimizer.zero_grad()
        nn.functional.cross_entropy(reference(x.cuda()), y.cuda()).backward()
        ref_optimizer.step()

    accelerator = Accelerator()
    assert accelerator.device == torch.device("cuda", torch.cuda.current_device())
    model = mlp()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.05),
                                                   DataLoader(data, batch_size=8))
    assert {p.device for p in model.parameters()} == {accelerator.device}
    seen = []
    for x, y in loader:
        seen.append((x.device, y.device))
        optimizer.zero_grad()
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
    assert seen == [(accelerator.device, accelerator.device)] * 8
    assert all(s["exp_avg"].device == accelerator.device for s in optimizer.state.values())
    for a, b in zip(reference.parameters(), accelerator.unwrap_model(model).parameters()):
        torch.testing.assert_close(a, b)


@pytest.mark.multiprocess  # a loader worker process
def test_pinned_non_blocking_batches_arrive_intact_and_in_order():
    data = dataset(40)
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(non_blocking=True))
    loader = accelerator.prepare(DataLoader(data, batch_size=8, pin_memory=True, num_workers=1))
    for epoch in range(2):
        got = [(x, y) for x, y in loader]
        assert all(x.is_cuda and y.is_cuda for x, y in got)
        assert torch.equal(torch.cat([x for x, _ in got]).cpu(), data.tensors[0]), f"epoch {epoch}"
        assert torch.equal(torch.cat([y for _, y in got]).cpu(), data.tensors[1]), f"epoch {epoch}"


def test_bf16_computes_in_bf16_on_the_gpu_and_keeps_fp32_master_weights():
    accelerator = Accelerator(mixed_precision="bf16")
    model = mlp()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                                                   DataLoader(dataset(64), batch_size=8))
    x, _ = next(iter(loader))
    with record_forward_dtypes(accelerator.unwrap_model(model)) as record:
        out = model(x)
    record.assert_dtype(torch.bfloat16, nn.Linear)
    assert out.dtype == torch.float32  # autocast's output converted back, as on the CPU
    losses = [sum(train(accelerator, model, optimizer, loader)) for _ in range(4)]
    assert losses[-1] < losses[0], losses
    assert assert_master_weights(optimizer, torch.float32, model=accelerator.unwrap_model(model)) == 4


def test_fp16_computes_in_fp16_and_the_cuda_grad_scaler_skips_overflowing_steps():
    accelerator = Accelerator(mixed_precision="fp16")
    model = mlp()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    (scaler,) = [c["scaler"] for c in accelerator._host.hook.torchrig_checkpoint_state(run=accelerator._run) if c]
    assert isinstance(scaler, torch.amp.GradScaler) and scaler._device == "cuda"
    x = torch.randn(4, 8, device=accelerator.device)
    with record_forward_dtypes(accelerator.unwrap_model(model)) as record:
        model(x)
    record.assert_dtype(torch.float16, nn.Linear)

    before = [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()
    accelerator.backward(model(x).sum() * float("inf"))
    optimizer.step()
    optimizer.zero_grad()
    assert accelerator.optimizer_step_was_skipped
    assert scaler.get_scale() == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))

    accelerator.backward(model(x).pow(2).mean())
    assert torch.isfinite(accelerator.clip_grad_norm_(model.parameters(), 1.0))  # unscaled first
    optimizer.step()
    assert not accelerator.optimizer_step_was_skipped
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _run(tmp_path, mixed_precision: str = "no"):
    torch.manual_seed(0)
    accelerator = Accelerator(mixed_precision=mixed_precision,
                              dataloader_config=DataLoaderConfiguration(data_seed=3))
    model = mlp(dropout=0.3)  # dropout draws from the cuda RNG: a resume must restore it
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = DataLoader(dataset(48), batch_size=4, shuffle=True)
    return (accelerator, *accelerator.prepare(model, optimizer, scheduler, loader))


@pytest.mark.parametrize("mixed_precision", ["no", "fp16"])
def test_save_state_and_load_state_resume_bit_identically_with_the_cuda_rng(tmp_path, mixed_precision):
    accelerator, model, optimizer, scheduler, loader = _run(tmp_path, mixed_precision)
    iterator = iter(loader)
    train(accelerator, model, optimizer, iterator, 3, scheduler)
    accelerator.save_state(tmp_path / "ckpt")
    expected_losses = train(accelerator, model, optimizer, iterator, 5, scheduler)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    expected_draw = torch.rand(4, device=accelerator.device)

    torch.cuda.manual_seed_all(12345)  # a different cuda RNG, parameters and position
    train(accelerator, model, optimizer, iter(loader), 2, scheduler)
    accelerator.load_state(tmp_path / "ckpt")
    iterator = iter(loader)
    assert train(accelerator, model, optimizer, iterator, 5, scheduler) == expected_losses
    got = model.state_dict()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert torch.equal(torch.rand(4, device=accelerator.device), expected_draw)


@pytest.mark.multiprocess  # inductor's compile workers
@pytest.mark.timeout(300)  # inductor compiles GPU kernels (Triton) on the first steps
def test_inductor_compiles_the_model_into_gpu_kernels_and_the_compiled_code_runs():
    torch._dynamo.reset()
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    model = mlp()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01),
                                                   DataLoader(dataset(64), batch_size=8, drop_last=True))
    with count_compilation() as counts:
        losses = [sum(train(accelerator, model, optimizer, loader)) for _ in range(3)]
    assert_compiled(counts, max_graph_breaks=0, max_recompiles=0)
    assert losses[-1] < losses[0], losses
    report = accelerator.compile_report()
    assert report["checked"] and all(stats["compiled"] for stats in report["modules"].values()), report
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        model(next(iter(loader))[0])
        torch.cuda.synchronize()
    kernels = [event.key for event in profile.key_averages()]
    assert any(name.startswith("triton_") for name in kernels), kernels  # inductor's generated kernels ran
    torch._dynamo.reset()


def test_a_forced_cuda_device_is_the_one_used(monkeypatch):
    """The other side of the CPU test that refuses a forced device that is absent: here it is present."""
    monkeypatch.setenv("TORCHRIG_DEVICE", "cuda")
    accelerator = Accelerator()
    assert accelerator.device.type == "cuda"
    model = accelerator.prepare(mlp())
    assert next(model.parameters()).is_cuda


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers, config, transformers.LlamaForCausalLM(config)


def _train_steps(accelerator: Accelerator, model, optimizer, steps: int = 3) -> list[float]:
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2)).to(accelerator.device)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_transformers_llama_trains_in_bf16_and_its_weights_go_out_and_back_in(tmp_path):
    """A transformers model on the GPU: bf16 training, save_model read by from_pretrained bit-exactly, and
    load_pretrained_weights into a prepared copy (the installed transformers, not the pinned CPU one)."""
    transformers, config, model = _tiny_llama()
    accelerator = Accelerator(mixed_precision="bf16")
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    assert next(model.parameters()).is_cuda
    losses = _train_steps(accelerator, model, optimizer)
    assert losses[-1] < losses[0]
    accelerator.save_model(model, tmp_path / "out")
    trained = {k: v.detach().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    torch.manual_seed(1)
    fresh = accelerator.prepare(transformers.LlamaForCausalLM(config))
    accelerator.load_pretrained_weights(fresh, tmp_path / "out")
    for name, tensor in accelerator.unwrap_model(fresh).state_dict().items():
        assert torch.equal(tensor.cpu(), trained[name]), name


def test_lora_on_the_gpu_trains_the_adapters_alone_and_saves_them_alone(tmp_path):
    peft = pytest.importorskip("peft")
    _, _, model = _tiny_llama()
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    accelerator = Accelerator(mixed_precision="bf16")
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    _train_steps(accelerator, model, optimizer)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert {id(p) for p in optimizer.state} == {id(p) for p in trainable}  # state for the adapters only
    for name, param in accelerator.unwrap_model(model).named_parameters():
        if name in frozen:
            assert torch.equal(param.detach().cpu(), frozen[name].cpu()), name
    accelerator.save_model(model, tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "adapter"))
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
