"""A model never passed to ``accelerator.prepare`` in a 2-rank data-parallel run: each rank trains
its own diverging copy. torchrig warns once, naming the parameters and the fix; with the fix
followed (the model prepared) the replicas stay equal and nothing is said. One pooled run of two
real gloo ranks covers the three ways in (accelerator.backward, a prepared optimizer's step after
a plain loss.backward(), a loss scale outside the prepared model), and the silent cases."""

from __future__ import annotations

import warnings

import pytest
import torch
from torchrig.testing.contracts import rank_environment
from torchrig.training.unprepared import UnpreparedParameterWarning, graph_parameters

pytestmark = pytest.mark.multiprocess

STEPS = 3


def _train(accelerator, model, optimizer, generator, *, extra=None, plain_backward=False):
    """A few steps on this rank's own data; the warnings caught and the final weights."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            loss = model(torch.randn(8, 4, generator=generator)).pow(2).mean()
            if extra is not None:
                loss = loss * extra
            if plain_backward:
                loss.backward()
            else:
                accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    messages = [str(w.message) for w in caught if issubclass(w.category, UnpreparedParameterWarning)]
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return messages, weights


def _scenarios(ctx):
    from torchrig import Accelerator

    results = {}
    with rank_environment(ctx.rank, ctx.world_size):
        generator = torch.Generator().manual_seed(100 + ctx.rank)  # each rank its own data

        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(4, 2)  # never prepared: the case
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        results["unprepared"] = _train(accelerator, model, optimizer, generator)

        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(4, 2)
        optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))  # only the optimizer
        results["plain_backward"] = _train(accelerator, model, optimizer, generator, plain_backward=True)

        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(4, 2)
        scale = torch.nn.Parameter(torch.ones(()))  # a learnable loss scale outside the model
        model, optimizer, scale_optimizer = accelerator.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD([scale], lr=0.1))
        messages, _ = _train(accelerator, model, optimizer, generator, extra=scale)
        scale_optimizer.step()
        results["loss_scale"] = (messages, scale.detach().reshape(1))

        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(4, 2)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # the advice
        results["prepared"] = _train(accelerator, model, optimizer, generator)
        plan = accelerator.step_plan  # the checks have looked: out of the hot path
        results["plan_after"] = (plan.backward.__name__, plan.optimizer_step.__name__)

        torch.manual_seed(0)
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(torch.nn.Linear(4, 2))  # prepared alone: a plain optimizer stays in step
        results["model_only"] = _train(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), generator)
        results["strategy"] = accelerator.strategy
    return results


@pytest.fixture(scope="module")
def runs(gloo_pool):
    return gloo_pool.run(_scenarios, timeout=240)


def _both(runs, name):
    return runs[0][name], runs[1][name]


def test_an_unprepared_model_is_named_once_and_its_replicas_diverge(runs):
    assert runs[0]["strategy"] == "ddp"
    (messages0, weights0), (messages1, weights1) = _both(runs, "unprepared")
    assert not torch.equal(weights0, weights1)  # what the warning is about: the replicas drifted apart
    for messages in (messages0, messages1):
        assert len(messages) == 1, messages  # once, not once per step
        assert "2 parameter tensor(s) (10 elements" in messages[0] and "(2, 4)" in messages[0]
        assert "2-way data parallel" in messages[0] and "accelerator.prepare" in messages[0]


def test_a_prepared_optimizer_after_a_plain_backward_is_checked_at_its_first_step(runs):
    for messages, _ in _both(runs, "plain_backward"):
        assert len(messages) == 1 and "the prepared SGD's step" in messages[0], messages


def test_a_loss_scale_outside_the_prepared_model_is_named(runs):
    (messages0, scale0), (messages1, scale1) = _both(runs, "loss_scale")
    assert not torch.equal(scale0, scale1)  # it really diverged
    for messages in (messages0, messages1):
        assert len(messages) == 1 and "1 parameter tensor(s) (1 elements; shapes ()" in messages[0], messages
        assert "accelerator.reduce(param.grad, 'mean')" in messages[0]


def test_with_the_advice_followed_the_replicas_are_equal_and_nothing_is_said(runs):
    for name in ("prepared", "model_only"):
        (messages0, weights0), (messages1, weights1) = _both(runs, name)
        assert messages0 == messages1 == [], name
        assert torch.equal(weights0, weights1), name
    assert "checked_backward" not in runs[0]["plan_after"] and "checked_step" not in runs[0]["plan_after"]


def test_one_process_is_never_warned():
    from torchrig import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 2)
    messages, _ = _train(accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1), torch.Generator())
    assert messages == []
    assert accelerator.step_plan.backward.__name__ != "checked_backward"  # never in the plan: nothing to diverge


def test_graph_parameters_are_the_leaves_a_backward_accumulates_into():
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    frozen = model[2].bias.requires_grad_(False)
    found = graph_parameters(model(torch.randn(2, 3)).sum())
    assert {id(p) for p in found} == {id(p) for p in model.parameters() if p is not frozen}
    assert graph_parameters(torch.ones(2).sum()) == []
