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
    accelerator.backward(model(torch.ones(2, 4)).pow(2).mean())
    optimizer.step()
    assert scaler._growth_tracker.item() == 1  # the step's update() counted one finite step on this scaler


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_scaler_is_none_without_loss_scaling(mixed_precision):
    """Accelerate's ``accelerator.scaler`` is None when nothing scales the loss (fp32, bf16)."""
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision)
    accelerator.prepare(nn.Linear(4, 2))
    assert accelerator.scaler is None
