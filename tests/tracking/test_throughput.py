"""The throughput monitor (issue 21): its window arithmetic against hand computation, the FLOPs
estimate against ``FlopCounterMode``, the peak-FLOPs table, and a short real training whose jsonl
tracker file is read back. The disabled path's cost is tests/training/test_hot_path_budget.py's."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchrig import Accelerator
from torchrig.config.options import ThroughputMonitorConfig
from torchrig.tracking.throughput import (
    PEAK_FLOPS,
    Reading,
    estimate_flops_per_token,
    gpu_table_key,
    measure_flops_per_step,
    non_embedding_params,
    peak_flops,
    transformer_flops_per_token,
    window_rates,
)


def test_window_rates_match_hand_computation():
    first, last = Reading(time=10.0, steps=5, samples=320, tokens=320 * 128), Reading(
        time=12.5, steps=15, samples=960, tokens=960 * 128)
    rates = window_rates(first, last, world_size=4, flops_per_token=1e9, peak_flops_per_device=1e14)
    # 10 steps in 2.5 s; 640 samples, 81,920 tokens; 8.192e13 FLOPs in 2.5 s over 4 × 1e14 FLOP/s.
    assert rates["throughput/step_time"] == pytest.approx(0.25)
    assert rates["throughput/samples_per_sec"] == pytest.approx(256.0)
    assert rates["throughput/samples_per_sec_per_device"] == pytest.approx(64.0)
    assert rates["throughput/tokens_per_sec"] == pytest.approx(32768.0)
    assert rates["throughput/tokens_per_sec_per_device"] == pytest.approx(8192.0)
    assert rates["throughput/mfu"] == pytest.approx(640 * 128 * 1e9 / 2.5 / 4e14)
    # flops_per_sample wins over flops_per_token: 640 samples × 2e11 FLOPs.
    by_sample = window_rates(first, last, world_size=4, flops_per_sample=2e11, flops_per_token=1e9,
                             peak_flops_per_device=1e14)
    assert by_sample["throughput/mfu"] == pytest.approx(640 * 2e11 / 2.5 / 4e14)


def test_window_rates_leave_out_what_is_unknown():
    first, last = Reading(0.0, 0, 0, 0), Reading(2.0, 4, 0, 0)
    assert window_rates(first, last, world_size=1, flops_per_token=1e9, peak_flops_per_device=1e12) == {
        "throughput/step_time": 0.5}
    counted = Reading(2.0, 4, 64, 0)
    assert "throughput/mfu" not in window_rates(first, counted, world_size=1, flops_per_token=1e9)  # no peak
    assert "throughput/mfu" not in window_rates(first, counted, world_size=1, peak_flops_per_device=1e12)
    assert window_rates(first, first, world_size=1) == {}


@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"),
    ("Tesla V100-SXM2-16GB", "v100"), ("NVIDIA GeForce GTX 1080", None),
])
def test_gpu_names_map_to_the_table(name, key):
    assert gpu_table_key(name) == key


def test_peak_flops_by_precision():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8") == pytest.approx(1978.9e12)
    assert peak_flops("NVIDIA A100-SXM4-40GB", "fp8") is None  # no fp8 on Ampere
    assert peak_flops("NVIDIA GeForce GTX 1080", "bf16") is None
    assert all(table["bf16" if "bf16" in table else "fp16"] > table["fp32"] for table in PEAK_FLOPS.values())


class FlopCountedDecoder(nn.Module):
    """A decoder-shaped model stating ``n_layer``/``d_model`` like a Hugging Face config does."""

    def __init__(self, vocab=64, d_model=32, n_layer=2, heads=4):
        super().__init__()
        self.n_layer, self.d_model, self.heads = n_layer, d_model, heads
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(nn.ModuleDict({
            "qkv": nn.Linear(d_model, 3 * d_model, bias=False), "out": nn.Linear(d_model, d_model, bias=False),
            "up": nn.Linear(d_model, 4 * d_model, bias=False), "down": nn.Linear(4 * d_model, d_model, bias=False),
        }) for _ in range(n_layer))
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        batch, seq, _ = x.shape
        for block in self.blocks:
            q, k, v = block["qkv"](x).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            # Attention written out: FlopCounterMode (torch 2.x) does not count the CPU's fused
            # scaled_dot_product_attention kernel, so F.scaled_dot_product_attention would read as 0 here.
            weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
            attended = (weights @ v).transpose(1, 2).reshape(batch, seq, -1)
            x = x + block["out"](attended)
            x = x + block["down"](F.gelu(block["up"](x)))
        return self.head(x)


def test_flops_estimate_matches_flop_counter_on_a_tiny_transformer():
    torch.manual_seed(0)
    model, seq, batch = FlopCountedDecoder(), 16, 4
    ids = torch.randint(0, 64, (batch, seq))
    measured = measure_flops_per_step(lambda: model(ids).sum().backward()) / (batch * seq)
    estimate = estimate_flops_per_token(model, seq)
    n = non_embedding_params(model)
    assert n == sum(p.numel() for p in model.parameters()) - 64 * 32
    assert estimate == transformer_flops_per_token(n, 2, 32, seq) == 6 * n + 12 * 2 * 32 * seq
    # Stated tolerance: 1% (FlopCounterMode counts the same matmuls and attention; no elementwise work).
    assert estimate == pytest.approx(measured, rel=0.01)


def test_estimate_needs_the_model_to_state_its_shape():
    assert estimate_flops_per_token(nn.Linear(4, 4), 16) is None


def _train(tmp_path, monitor: ThroughputMonitorConfig, batches=13, batch_size=8, report=None):
    accelerator = Accelerator(cpu=True, log_with="jsonl", project_dir=str(tmp_path), kwargs_handlers=[monitor])
    model, optimizer = nn.Linear(4, 2), None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    dataset = TensorDataset(torch.randn(batches * batch_size, 4), torch.randn(batches * batch_size, 2))
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=batch_size))
    accelerator.init_trackers("run")
    for x, y in loader:
        if report is not None:
            accelerator.throughput.update(**report)
        accelerator.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.end_training()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return accelerator, [line for line in lines if line["event"] == "log"]


def test_a_short_training_logs_throughput_to_the_jsonl_tracker(tmp_path):
    monitor = ThroughputMonitorConfig(enabled=True, log_every_n_steps=4, tokens_per_sample=16, flops_per_token=50.0,
                                      peak_flops_per_device=1e9)
    accelerator, logs = _train(tmp_path, monitor)
    # The first step's end starts the first window; then one record every 4 steps: steps 5, 9, 13.
    assert [line["step"] for line in logs] == [5, 9, 13]
    for line in logs:
        values = line["values"]
        assert set(values) == {"throughput/step_time", "throughput/samples_per_sec",
                               "throughput/samples_per_sec_per_device", "throughput/tokens_per_sec",
                               "throughput/tokens_per_sec_per_device", "throughput/mfu", "memory/peak_allocated_gib"}
        # One global batch of 8 per step, 16 tokens a sample: rates × step time give them back.
        assert values["throughput/samples_per_sec"] * values["throughput/step_time"] == pytest.approx(8.0)
        assert values["throughput/tokens_per_sec"] == pytest.approx(16 * values["throughput/samples_per_sec"])
        assert values["throughput/mfu"] == pytest.approx(values["throughput/tokens_per_sec"] * 50.0 / 1e9)
        assert values["memory/peak_allocated_gib"] > 0.01  # a Python process with torch: well over 10 MiB RSS
    assert accelerator.throughput.latest == logs[-1]["values"]
    assert accelerator.throughput.steps == 13
    assert "samples/s" in accelerator.throughput.progress() and "MFU" in accelerator.throughput.progress()


def test_reported_counts_win_and_window_size_averages_intervals(tmp_path):
    monitor = ThroughputMonitorConfig(enabled=True, log_every_n_steps=2, window_size=3)
    accelerator, logs = _train(tmp_path, monitor, batches=9, report={"samples": 5, "tokens": 70})
    assert [line["step"] for line in logs] == [3, 5, 7, 9]
    for line in logs:
        values = line["values"]
        assert values["throughput/samples_per_sec"] * values["throughput/step_time"] == pytest.approx(5.0)
        assert values["throughput/tokens_per_sec"] * values["throughput/step_time"] == pytest.approx(70.0)
        assert "throughput/mfu" not in values  # no FLOPs, no peak on a CPU
    assert accelerator.throughput._readings[0].steps == 3  # 3 intervals back from step 9


def test_disabled_monitor_leaves_the_step_plan_alone(tmp_path):
    accelerator = Accelerator(cpu=True)
    plain = accelerator.step_plan.optimizer_step
    assert not accelerator.throughput.active and accelerator.throughput.progress() == ""
    enabled = Accelerator(cpu=True, kwargs_handlers=[ThroughputMonitorConfig(enabled=True)])
    assert enabled.step_plan.optimizer_step.__qualname__.startswith("ThroughputMonitor.wrap_optimizer_step")
    assert not plain.__qualname__.startswith("ThroughputMonitor")


@pytest.mark.parametrize("key, value", [("log_every_n_steps", 0), ("window_size", 0), ("tokens_per_sample", 0),
                                        ("peak_flops_per_device", -1.0)])
def test_bad_values_are_refused_naming_the_option(key, value):
    with pytest.raises((ValueError, TypeError), match=key):
        ThroughputMonitorConfig(**{key: value})


def test_finite_rates_after_a_measured_window():
    assert math.isfinite(window_rates(Reading(0, 0, 0, 0), Reading(1e-9, 1, 1, 0), world_size=1)[
        "throughput/samples_per_sec"])


def test_the_monitor_is_enabled_from_the_environment_and_bad_values_name_their_source(monkeypatch):
    monkeypatch.setenv("TORCHRIG_THROUGHPUT_MONITOR__ENABLED", "1")
    assert Accelerator(cpu=True).throughput.active
    monkeypatch.setenv("TORCHRIG_THROUGHPUT_MONITOR__LOG_EVERY_N_STEPS", "0")
    with pytest.raises(Exception, match=r"throughput_monitor\.log_every_n_steps \(environment TORCHRIG_THROUGHPUT"):
        Accelerator(cpu=True)


TWO_RANK_SCRIPT = '''
import sys
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchrig import Accelerator
from torchrig.config.options import ThroughputMonitorConfig

accelerator = Accelerator(cpu=True, log_with="jsonl", project_dir=sys.argv[1],
                          kwargs_handlers=[ThroughputMonitorConfig(enabled=True, log_every_n_steps=5)])
data = TensorDataset(torch.randn(16 * 32, 4), torch.randn(16 * 32, 2))  # 16 steps of 2 x 16 samples
model = nn.Linear(4, 2)
model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                               DataLoader(data, batch_size=16))
accelerator.init_trackers("run")
for x, y in loader:
    accelerator.backward(F.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
print(f"rank {accelerator.process_index}: active={accelerator.throughput.active} logged={bool(accelerator.throughput.latest)}")
accelerator.end_training()
'''


@pytest.mark.timeout(240)
def test_two_ranks_count_global_samples_and_only_the_main_process_logs(tmp_path, process_guard):
    script = tmp_path / "train.py"
    script.write_text(TWO_RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "2", str(script),
                             str(tmp_path / "project")], start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    process_guard.track(proc)
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == 0, out
    assert "rank 0: active=True logged=True" in out and "rank 1: active=False logged=False" in out, out
    logs = [json.loads(line) for line in (tmp_path / "project" / "run" / "metrics.jsonl").read_text().splitlines()]
    logs = [line for line in logs if line["event"] == "log"]
    assert [line["step"] for line in logs] == [6, 11, 16]
    for line in logs:
        values = line["values"]
        # One global batch is 2 ranks × 16 samples per optimizer step.
        assert values["throughput/samples_per_sec"] * values["throughput/step_time"] == pytest.approx(32.0)
        assert values["throughput/samples_per_sec_per_device"] == pytest.approx(values["throughput/samples_per_sec"] / 2)
