"""The prepared optimizer is a ``torch.optim.Optimizer``, as Accelerate's ``AcceleratedOptimizer`` is:
torch's and transformers' schedulers (which type-check their optimizer) accept it, and everything an
optimizer has — ``param_groups``, ``state``, ``defaults``, ``state_dict``/``load_state_dict``,
``add_param_group``, ``zero_grad``, ``step`` — behaves as the wrapped optimizer's, under the single
and ddp strategies. transformers' wav2vec2 pretraining script (examples/pytorch/speech-pretraining/
run_wav2vec2_pretraining_no_trainer.py) builds its scheduler from the prepared optimizer with
``transformers.get_scheduler``; that call died with ``TypeError: AcceleratedOptimizer is not an
Optimizer``."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torchrig import Accelerator
from torchrig.optimizer import AcceleratedOptimizer
from torchrig.testing.contracts import rank_environment

TIMEOUT = 180  # seconds a pooled run may take before the test gives up (not a measurement)
STEPS = 4


def _inputs(step: int) -> torch.Tensor:
    return torch.arange(8, dtype=torch.float32).reshape(2, 4) / (step + 1)


def _same_tensors(left: object, right: object) -> bool:
    if isinstance(left, torch.Tensor):
        return isinstance(right, torch.Tensor) and torch.equal(left, right)
    if isinstance(left, dict):
        return isinstance(right, dict) and left.keys() == right.keys() and all(
            _same_tensors(left[key], right[key]) for key in left)
    if isinstance(left, (list, tuple)):
        return len(left) == len(right) and all(_same_tensors(a, b) for a, b in zip(left, right))
    return left == right


def _optimizer_behaves_as_the_wrapped_one(strategy: str) -> dict[str, object]:
    """Train a prepared AdamW with a torch scheduler built on the prepared optimizer, next to a plain AdamW
    with the same scheduler; every rank feeds the same batch, so DDP's averaged gradients equal the plain ones."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    reference = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True, strategy=strategy)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.01)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, inner)
    seen: dict[str, object] = {"is_optimizer": isinstance(optimizer, torch.optim.Optimizer),
                               "is_accelerated": isinstance(optimizer, AcceleratedOptimizer)}
    seen["same_views"] = (optimizer.param_groups is inner.param_groups and optimizer.state is inner.state
                          and optimizer.defaults is inner.defaults)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_optimizer, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. torch's "lr_scheduler.step() before optimizer.step()"
        for step in range(STEPS):
            accelerator.backward(model(_inputs(step)).pow(2).sum())
            reference(_inputs(step)).pow(2).sum().backward()
            optimizer.step()
            reference_optimizer.step()
            scheduler.step()
            reference_scheduler.step()
            optimizer.zero_grad()
            reference_optimizer.zero_grad()
    unwrapped = accelerator.unwrap_model(model)
    seen["weights_equal"] = all(torch.equal(a, b) for a, b in zip(unwrapped.parameters(), reference.parameters()))
    seen["grads_cleared"] = all(param.grad is None for param in unwrapped.parameters())
    seen["lrs"] = [group["lr"] for group in optimizer.param_groups]
    seen["reference_lrs"] = [group["lr"] for group in reference_optimizer.param_groups]
    seen["state_dict_equal"] = _same_tensors(optimizer.state_dict(), reference_optimizer.state_dict())
    seen["state_dict_is_inner"] = _same_tensors(optimizer.state_dict(), inner.state_dict())

    # load_state_dict goes to the wrapped optimizer: load the state of one step back, then compare
    earlier = copy.deepcopy(optimizer.state_dict())
    earlier["param_groups"][0]["lr"] = 0.125
    optimizer.load_state_dict(earlier)
    seen["loaded_lr"] = inner.param_groups[0]["lr"]

    # add_param_group and the setters reach the wrapped optimizer
    extra = nn.Parameter(torch.zeros(2))
    optimizer.add_param_group({"params": [extra], "lr": 0.01})
    seen["groups_after_add"] = [len(inner.param_groups), inner.param_groups[1]["params"][0] is extra,
                                inner.param_groups[1]["weight_decay"]]
    groups = inner.param_groups[:1]
    optimizer.param_groups = groups
    seen["param_groups_setter"] = inner.param_groups is groups
    accelerator.end_training()
    return seen


EXPECTED = {"is_optimizer": True, "is_accelerated": True, "same_views": True, "weights_equal": True,
            "grads_cleared": True, "state_dict_equal": True, "state_dict_is_inner": True, "loaded_lr": 0.125,
            "groups_after_add": [2, True, 0.01], "param_groups_setter": True}


def _check(seen: dict[str, object]) -> None:
    for key, value in EXPECTED.items():
        assert seen[key] == value, (key, seen[key])
    assert seen["lrs"] == seen["reference_lrs"] == [0.1 * 0.5 ** STEPS]


def test_the_prepared_optimizer_is_a_torch_optimizer_that_behaves_as_the_wrapped_one():
    _check(_optimizer_behaves_as_the_wrapped_one("single"))


def _under_ddp(ctx) -> dict[str, object]:
    with rank_environment(ctx.rank, ctx.world_size):
        return _optimizer_behaves_as_the_wrapped_one("ddp")


@pytest.mark.multiprocess
def test_the_prepared_optimizer_is_a_torch_optimizer_that_behaves_as_the_wrapped_one_under_ddp(gloo_pool):
    results = gloo_pool.run(_under_ddp, timeout=TIMEOUT)
    assert len(results) == 2
    for seen in results:
        _check(seen)


def test_step_and_zero_grad_still_wait_for_the_accumulation_boundary():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    before = [param.detach().clone() for param in model.parameters()]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with accelerator.accumulate(model):
        accelerator.backward(model(_inputs(0)).sum())
        optimizer.step()
        optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))  # deferred: not stepped
    assert all(param.grad is not None for param in model.parameters())  # nor zeroed
    with accelerator.accumulate(model):
        accelerator.backward(model(_inputs(1)).sum())
        optimizer.step()
        optimizer.zero_grad()
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert all(param.grad is None for param in model.parameters())
    accelerator.end_training()


def test_a_scheduler_built_on_the_prepared_optimizer_can_be_prepared_and_the_optimizer_is_not_wrapped_twice():
    model = nn.Linear(4, 3)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5))
    assert accelerator.prepare(optimizer) is optimizer
    accelerator.backward(model(_inputs(0)).sum())
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5
    accelerator.end_training()


def test_the_wav2vec2_pretraining_scripts_scheduler_accepts_the_prepared_optimizer():
    """The script's own sequence: prepare, then transformers.get_scheduler(optimizer=the prepared optimizer),
    stepped after each optimizer step unless accelerator.optimizer_step_was_skipped; the lr it logs is
    optimizer.param_groups[0]["lr"]."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    reference = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(list(model.parameters()), lr=1e-3))
    lr_scheduler = transformers.get_scheduler(name="linear", optimizer=optimizer, num_warmup_steps=2,
                                              num_training_steps=STEPS)
    reference_optimizer = torch.optim.AdamW(list(reference.parameters()), lr=1e-3)
    reference_scheduler = transformers.get_scheduler(name="linear", optimizer=reference_optimizer,
                                                     num_warmup_steps=2, num_training_steps=STEPS)
    logged, expected = [], []
    for step in range(STEPS):
        accelerator.backward(model(_inputs(step)).sum())
        optimizer.step()
        optimizer.zero_grad()
        if not accelerator.optimizer_step_was_skipped:
            lr_scheduler.step()
        logged.append(optimizer.param_groups[0]["lr"])  # the script logs torch.tensor(of it)
        reference(_inputs(step)).sum().backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        reference_scheduler.step()
        expected.append(reference_optimizer.param_groups[0]["lr"])
    assert logged == expected and logged[-1] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    accelerator.end_training()
