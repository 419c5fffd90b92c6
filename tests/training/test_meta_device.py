"""init_empty_weights / init_on_device (Accelerate's big_modeling context managers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1d(3)  # running_mean/var are buffers
        self.register_buffer("table", torch.arange(6.0))


def test_parameters_on_meta_buffers_stay_by_default():
    from torchrig import init_empty_weights

    with init_empty_weights():
        model = WithBuffer()
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in model.parameters())
    assert model.linear.weight.shape == (3, 4)
    assert {b.device.type for b in model.buffers()} == {"cpu"}
    assert torch.equal(model.table, torch.arange(6.0))  # computed at construction, kept
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone


def test_include_buffers_puts_buffers_on_meta_too(monkeypatch):
    from torchrig.big_modeling import init_empty_weights

    with init_empty_weights(include_buffers=True):
        model = WithBuffer()
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "true")  # Accelerate's variable sets the default
    with init_empty_weights():
        model = WithBuffer()
    assert model.table.device.type == "meta"
    monkeypatch.setenv("ACCELERATE_INIT_INCLUDE_BUFFERS", "maybe")
    with pytest.raises(ValueError, match="ACCELERATE_INIT_INCLUDE_BUFFERS='maybe': expected true or false"), \
            init_empty_weights():
        pass


def test_init_on_device_keeps_parameter_class_and_flags():
    from torchrig.training.meta_device import init_on_device

    class Tagged(nn.Parameter):
        pass

    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = Tagged(torch.ones(2), requires_grad=False)

    with init_on_device("meta"):
        module = Frozen()
    assert type(module.weight) is Tagged and module.weight.device.type == "meta"
    assert not module.weight.requires_grad


def test_register_parameter_is_restored_even_when_the_block_raises():
    from torchrig.training.meta_device import init_empty_weights

    original = nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="construction failed"), init_empty_weights():
        nn.Linear(2, 2)
        raise RuntimeError("construction failed")
    assert nn.Module.register_parameter is original
    assert nn.Linear(2, 2).weight.device.type == "cpu"
