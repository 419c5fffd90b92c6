"""Accelerate attributes transformers' no_trainer scripts read that torchrig lacked (each found by running a script
or by listing the calls the scripts make), checked in one process without a launcher."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torchrig import Accelerator


@pytest.fixture(autouse=True)
def _private_config_home(tmp_path, monkeypatch):
    """No machine default config file or TORCHRIG_* variable of the caller changes these runs."""
    for name in [n for n in os.environ if n.startswith("TORCHRIG_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path / "config-home"))


def test_scaler_is_the_grad_scaler_the_fp16_step_uses():
    """run_wav2vec2_pretraining_no_trainer.py logs ``accelerator.scaler._scale`` under fp16 (Accelerate's attribute;
    torchrig had none): it is the GradScaler the step goes through, so its scale moves with the steps."""
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model = nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    scaler = accelerator.scaler
    assert isinstance(scaler, torch.amp.GradScaler), scaler
    # Small inputs keep the fp16 gradient of the scaled loss (2**16 x output / 4) finite for any initialisation: a
    # random Linear could output > 2 on ones, overflow in fp16, and the scaler would rightly skip that step.
    accelerator.backward(model(torch.full((2, 4), 0.01)).pow(2).mean())
    optimizer.step()
    assert scaler._growth_tracker.item() == 1  # the step's update() counted one finite step on this scaler


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_scaler_is_none_without_loss_scaling(mixed_precision):
    """Accelerate's ``accelerator.scaler`` is None when nothing scales the loss (fp32, bf16)."""
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    accelerator.prepare(nn.Linear(4, 2))
    assert accelerator.scaler is None


def _run(batch_size: int = 4):
    """A fresh Accelerator with a seeded model, optimizer and loader (the same run each time it is called)."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Linear(4, 2)
    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    return accelerator, model, optimizer, loader


def _train_one_step(accelerator, model, optimizer, batch) -> None:
    accelerator.backward(model(batch[0]).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.multiprocess  # saving starts a helper process (ldconfig), as test_checkpoints.py's saves do
def test_a_resumed_run_replaces_the_checkpoints_it_re_creates(tmp_path):
    """The no_trainer scripts resume with the same ``--output_dir``: after ``load_state(out/step_1)`` the run saves
    ``out/step_2`` again, which the first run committed. Accelerate overwrites it; torchrig refused it
    ("a committed checkpoint is already there"), so ``--resume_from_checkpoint`` died at the next checkpoint. A
    checkpoint of the same run (same configuration and data order) is replaced atomically after a resume; the new
    state is what loads back."""
    accelerator, model, optimizer, loader = _run()
    batches = iter(loader)
    accelerator.save_state(tmp_path / "step_1")
    _train_one_step(accelerator, model, optimizer, next(batches))
    accelerator.save_state(tmp_path / "step_2")

    accelerator, model, optimizer, loader = _run()
    accelerator.load_state(tmp_path / "step_1")
    _train_one_step(accelerator, model, optimizer, next(iter(loader)))
    _train_one_step(accelerator, model, optimizer, next(iter(loader)))  # diverges from the first run on purpose
    expected = model.weight.detach().clone()
    accelerator.save_state(tmp_path / "step_2")

    accelerator, model, optimizer, loader = _run()
    accelerator.load_state(tmp_path / "step_2")
    assert torch.equal(model.weight.detach(), expected)


@pytest.mark.multiprocess  # saving starts a helper process (ldconfig), as test_checkpoints.py's saves do
def test_a_resumed_run_still_refuses_another_runs_checkpoint(tmp_path):
    """Only the resumed run's own checkpoints are replaced: one written by a run with another data order (batch size
    8, not 4) is still refused by name."""
    from torchrig.checkpoint.files import CheckpointError

    other, *_ = _run(batch_size=8)
    other.save_state(tmp_path / "step_2")
    accelerator, *_ = _run()
    accelerator.save_state(tmp_path / "step_1")
    accelerator.load_state(tmp_path / "step_1")
    with pytest.raises(CheckpointError, match="step_2: a committed checkpoint is already there"):
        accelerator.save_state(tmp_path / "step_2")
