"""The training guard: a NaN or spiking step is skipped on every rank and leaves the weights those
of a run that never trained on its batch; past max_skips (or with ``stop``) the run stops naming the
step and its batches; the skips reach the trackers; off, the step plan is not wrapped."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchrig import Accelerator
from torchrig.config.options import TrainingGuardConfig
from torchrig.errors import ConfigError
from torchrig.plugin.types import Capabilities
from torchrig.resilience.training_guard import SKIPPED_STEPS_METRIC, TrainingGuardStop

STEPS, BATCH = 8, 4
TORCHRIG = str(Path(__import__("torchrig").__file__).parent)


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(STEPS * BATCH, 16, generator=generator),
                         torch.randn(STEPS * BATCH, 2, generator=generator))


def _train(tmp_path, guard: TrainingGuardConfig | None, *, bad_steps=(), corrupt=lambda loss: loss * float("nan"),
           drop_steps=(), clip=False):
    """A tiny model trained with momentum and a decaying learning rate (so a step or scheduler advance
    that should have been skipped shows in the weights); returns the accelerator, model, tracker logs."""
    handlers = [guard] if guard is not None else []
    accelerator = Accelerator(cpu=True, log_with="jsonl", project_dir=str(tmp_path), kwargs_handlers=handlers)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    data = _data()
    kept = [i for i in range(len(data)) if i // BATCH not in drop_steps]
    loader = DataLoader(torch.utils.data.Subset(data, kept), batch_size=BATCH)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    accelerator.init_trackers("run")
    for step, (x, y) in enumerate(loader):
        loss = F.mse_loss(model(x), y)
        accelerator.backward(corrupt(loss) if step in bad_steps else loss)
        if clip:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    accelerator.end_training()
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return accelerator, model, [line for line in lines if line["event"] == "log"]


def _assert_same_weights(model, reference):
    for (name, param), expected in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(param, expected), name


@pytest.mark.parametrize("case", ["nan_loss", "nan_loss_clipped", "spike"])
def test_a_bad_step_is_skipped_and_the_weights_equal_a_run_without_its_batch(tmp_path, case):
    corrupt = (lambda loss: loss * 1000.0) if case == "spike" else (lambda loss: loss * float("nan"))
    guard = TrainingGuardConfig(enabled=True, spike_threshold=50.0)
    accelerator, model, logs = _train(tmp_path / "guarded", guard, bad_steps={3}, corrupt=corrupt,
                                      clip=case == "nan_loss_clipped")
    _, reference, _ = _train(tmp_path / "reference", None, drop_steps={3}, clip=case == "nan_loss_clipped")
    _assert_same_weights(model, reference)
    assert accelerator._training_guard.skipped_steps == 1
    assert [(line["step"], line["values"]) for line in logs] == [(3, {SKIPPED_STEPS_METRIC: 1})]


def test_past_max_skips_the_run_stops_naming_the_step_and_its_batch(tmp_path):
    guard = TrainingGuardConfig(enabled=True, max_skips=1)
    with pytest.raises(TrainingGuardStop, match=r"optimizer step 5 \(micro-batches 5–5 .*max_skips 1"):
        _train(tmp_path, guard, bad_steps={2, 5})


def test_on_nonfinite_stop_stops_at_the_first_bad_step(tmp_path):
    guard = TrainingGuardConfig(enabled=True, on_nonfinite="stop")
    with pytest.raises(TrainingGuardStop, match=r"NaN/inf .* optimizer step 2 .*on_nonfinite: stop"):
        _train(tmp_path, guard, bad_steps={2})


def test_a_loss_many_deviations_above_the_window_is_a_spike(tmp_path):
    guard = TrainingGuardConfig(enabled=True, spike_zscore=3.0, spike_window=3)
    accelerator, model, logs = _train(tmp_path / "guarded", guard, bad_steps={6}, corrupt=lambda loss: loss * 1000.0)
    _, reference, _ = _train(tmp_path / "reference", None, drop_steps={6})
    _assert_same_weights(model, reference)
    assert [line["step"] for line in logs] == [6]


def test_off_the_step_plan_is_not_wrapped():
    assert Accelerator(cpu=True)._training_guard is None
    assert "guarded" not in Accelerator(cpu=True).step_plan.optimizer_step.__qualname__
    assert "guarded" in Accelerator(cpu=True, kwargs_handlers=[TrainingGuardConfig(enabled=True)]) \
        .step_plan.optimizer_step.__qualname__


@pytest.mark.parametrize("key, value, message", [
    ("on_nonfinite", "ignore", "training_guard.on_nonfinite (environment TORCHRIG_TRAINING_GUARD__ON_NONFINITE): "
                               "expected 'skip', 'stop' or 'rollback'; got 'ignore'"),
    ("max_skips", "-1", "training_guard.max_skips (environment TORCHRIG_TRAINING_GUARD__MAX_SKIPS): must be at least 0"),
    ("spike_window", "1", "training_guard.spike_window (environment TORCHRIG_TRAINING_GUARD__SPIKE_WINDOW)"),
])
def test_bad_values_are_refused_naming_the_key_and_its_source(monkeypatch, key, value, message):
    monkeypatch.setenv(f"TORCHRIG_TRAINING_GUARD__{key.upper()}", value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        Accelerator(cpu=True)


TWO_RANK_SCRIPT = '''
import sys
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torchrig import Accelerator
from torchrig.config.options import TrainingGuardConfig

guarded = sys.argv[2] == "guarded"
handlers = [TrainingGuardConfig(enabled=True, spike_threshold=50.0)] if guarded else []
accelerator = Accelerator(cpu=True, log_with="jsonl", project_dir=sys.argv[1], kwargs_handlers=handlers)
generator = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(6 * 8, 16, generator=generator), torch.randn(6 * 8, 2, generator=generator))
# Global step k reads samples 8k..8k+7 (rank 0 the first 4, rank 1 the next 4); the reference drops steps 2 and 4.
data = data if guarded else Subset(data, [i for i in range(len(data)) if i // 8 not in (2, 4)])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=4))
accelerator.init_trackers("run")
for step, (x, y) in enumerate(loader):
    loss = F.mse_loss(model(x), y)
    if guarded and step == 2 and accelerator.process_index == 1:  # a NaN on one rank only
        loss = loss * float("nan")
    if guarded and step == 4 and accelerator.process_index == 1:  # a spike only rank 1's loss shows
        loss = loss * 1000.0
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
if accelerator.is_main_process:
    torch.save(accelerator.unwrap_model(model).state_dict(), sys.argv[1] + "/weights.pt")
accelerator.end_training()
'''


@pytest.mark.timeout(300)
def test_two_ranks_skip_a_nan_and_a_spike_seen_by_one_rank_and_match_the_run_without_their_batches(tmp_path, process_guard):
    script = tmp_path / "train.py"
    script.write_text(TWO_RANK_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1")
    for mode in ("guarded", "reference"):
        (tmp_path / mode).mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "2",
                                 str(script), str(tmp_path / mode), mode], start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        process_guard.track(proc)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out
    guarded, reference = (torch.load(tmp_path / mode / "weights.pt") for mode in ("guarded", "reference"))
    for name, param in guarded.items():
        assert torch.equal(param, reference[name]), name
    logs = [json.loads(line) for line in (tmp_path / "guarded" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["values"]) for line in logs if line["event"] == "log"] == [
        (2, {SKIPPED_STEPS_METRIC: 1}), (4, {SKIPPED_STEPS_METRIC: 2})]


#: torchrig's Python calls the guard adds to a training step when on (tests/training/test_hot_path_budget.py
#: counts the step itself): the guarded backward and optimizer step, the local norm, the agreement, the spike
#: check, the step's bookkeeping and the gradient list's comprehension (inlined from Python 3.12: one fewer).
GUARD_ON_EXTRA_CALLS = 7


def _torchrig_calls_per_step(guard: TrainingGuardConfig) -> collections.Counter:
    accelerator = Accelerator(cpu=True, kwargs_handlers=[guard])
    torch.manual_seed(0)
    model, optimizer = accelerator.prepare(nn.Linear(16, 2), torch.optim.SGD(nn.Linear(16, 2).parameters(), lr=0.1))
    x, y = _data().tensors

    def step() -> None:
        accelerator.backward(F.mse_loss(model(x[:BATCH]), y[:BATCH]))
        optimizer.step()
        optimizer.zero_grad()

    step()  # the first step builds the step plan
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(TORCHRIG):
            calls[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def test_off_the_guard_adds_no_call_to_the_step_and_on_a_fixed_few():
    off = _torchrig_calls_per_step(TrainingGuardConfig(enabled=False))
    on = _torchrig_calls_per_step(TrainingGuardConfig(enabled=True))
    assert not [name for name in off if name.startswith("training_guard.py")], off
    extra = sum(on.values()) - sum(off.values())
    assert extra <= GUARD_ON_EXTRA_CALLS, f"the guard now adds {extra} torchrig calls per step (budget " \
                                          f"{GUARD_ON_EXTRA_CALLS}): {dict(on - off)}"
    assert extra >= GUARD_ON_EXTRA_CALLS - 1, f"lower the budget to keep it tight: {dict(on - off)}"


def test_a_strategy_whose_engine_owns_the_step_and_fp16_loss_scaling_are_refused_by_name():
    accelerator = Accelerator(cpu=True, kwargs_handlers=[TrainingGuardConfig(enabled=True)])
    guard, plan = accelerator._training_guard, accelerator.step_plan
    with pytest.raises(ValueError, match=r"the 'deepspeed' strategy's engine owns the optimizer step .* 'ddp' or "
                                         r"'fsdp' strategy, or set training_guard.enabled: false"):
        guard.check_supported("deepspeed", Capabilities(owns_accumulation=True), plan)
    with pytest.raises(ValueError, match=r"fp16 loss scaling .* use mixed_precision 'bf16' or 'no'"):
        guard.check_supported("ddp", Capabilities(), attrs.evolve(plan, loss_scaler=torch.amp.GradScaler("cpu")))
    guard.check_supported("ddp", Capabilities(), plan)  # DDP/FSDP without fp16: accepted
