"""torchrig_convert_model: parameters a conversion replaces are followed into optimizers built
before prepare (param groups and state), and a conversion that drops a parameter is refused."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn
from torchrig.training.conversion import convert_model


def host_converting_with(convert):
    return types.SimpleNamespace(hook=types.SimpleNamespace(torchrig_convert_model=convert))


def replace_first_weight(run, model):
    model[0].weight = nn.Parameter(model[0].weight.detach() * 2)


def test_replaced_parameters_are_remapped_in_groups_and_state():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()  # state exists for every parameter
    old = model[0].weight
    old_state = optimizer.state[old]
    replaced = convert_model(host_converting_with(replace_first_weight), None, model, [optimizer])
    new = model[0].weight
    assert replaced == 1 and new is not old
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert any(p is new for p in held) and not any(p is old for p in held)
    assert optimizer.state[new] is old_state and old not in optimizer.state
    model(torch.randn(3, 4)).sum().backward()
    before = new.detach().clone()
    optimizer.step()
    assert not torch.equal(before, new)  # the optimizer steps the parameter the model uses


def test_a_conversion_that_drops_a_parameter_is_refused_by_name():
    def drop_bias(run, model):
        model[1].bias = None

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(RuntimeError, match=r"removed parameters \['1.bias'\]"):
        convert_model(host_converting_with(drop_bias), None, model, [])


def test_nothing_replaced_leaves_optimizers_alone():
    model = nn.Sequential(nn.Linear(4, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = [list(group["params"]) for group in optimizer.param_groups]
    assert convert_model(host_converting_with(lambda run, model: None), None, model, [optimizer]) == 0
    assert [list(group["params"]) for group in optimizer.param_groups] == groups
