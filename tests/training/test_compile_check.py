"""torch.compile that provably takes effect (issue 21): after the first optimizer steps the
Accelerator says, per compiled module or region, whether compiled code ran, and warns naming the
module when it did not (Accelerate #4188/#4253 ran the eager model and said nothing)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torchrig import Accelerator
from torchrig.config.options import TorchDynamoPlugin
from torchrig.testing.effects import assert_compiled, count_compilation
from torchrig.testing.models import CompileStack, LinearBlock
from torchrig.training.compile_check import CHECK_AFTER_STEPS, RECOMPILE_WARN_THRESHOLD, CompileVerifier


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(accelerator: Accelerator, model: nn.Module, steps: int = CHECK_AFTER_STEPS + 1,
           call: object = None) -> list[warnings.WarningMessage]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    forward = call(model) if call is not None else model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = forward(torch.randn(4, 8)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return [w for w in caught if "torch.compile" in str(w.message)]


def test_whole_model_compile_is_reported_compiled():
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    caught = _train(accelerator, CompileStack())
    report = accelerator.compile_report()
    assert report["checked"] is True
    assert list(report["modules"]) == ["CompileStack"]
    stats = report["modules"]["CompileStack"]
    assert stats["compiled"] and stats["calls"] == stats["compiled_calls"] == CHECK_AFTER_STEPS
    assert stats["graphs"] >= 1
    assert stats["graph_breaks"] == 0 and stats["recompiles"] == 0
    assert caught == []


def test_regional_compile_compiles_each_block():
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=True))
    caught = _train(accelerator, CompileStack(blocks=3))
    modules = accelerator.compile_report()["modules"]
    assert sorted(modules) == ["CompileStack.blocks.0", "CompileStack.blocks.1", "CompileStack.blocks.2"]
    # every block ran compiled code in every call, though same-class blocks share cached graphs
    # (a later block may compile nothing of its own: counters alone would call it eager)
    assert all(stats["compiled"] and stats["compiled_calls"] == stats["calls"] == CHECK_AFTER_STEPS
               for stats in modules.values())
    assert modules["CompileStack.blocks.0"]["graphs"] >= 1
    assert caught == []


@pytest.mark.multiprocess  # inductor starts the C++ compiler
def test_inductor_whole_model_runs_compiled():
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    _train(accelerator, CompileStack(blocks=1))
    assert accelerator.compile_report()["modules"]["CompileStack"]["compiled"] is True


def test_graph_break_is_counted_and_warned():
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=True))
    caught = _train(accelerator, CompileStack(blocks=2, graph_break=True))
    modules = accelerator.compile_report()["modules"]
    assert all(stats["compiled"] and stats["graph_breaks"] >= 1 for stats in modules.values())
    assert [str(w.message).split("'")[1] for w in caught] == ["CompileStack.blocks.0", "CompileStack.blocks.1"]
    assert all("graph break" in str(w.message) for w in caught)


def test_compiled_module_not_the_one_called_is_named_in_a_warning():
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    caught = _train(accelerator, CompileStack(), call=lambda compiled: compiled._orig_mod)  # runs the eager model
    stats = accelerator.compile_report()["modules"]["CompileStack"]
    assert stats["compiled"] is False and stats["calls"] == 0
    assert len(caught) == 1
    assert "'CompileStack' did not run compiled code" in str(caught[0].message)
    assert "never called" in str(caught[0].message)


def test_disabled_dynamo_is_reported():
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    # torch's own patch: pytest >= 9.2's monkeypatch deletes a module attribute it did not find in the
    # module's __dict__ on undo, which hides the option from torch's config module for the rest of the session
    with torch._dynamo.config.patch(disable=True):
        caught = _train(accelerator, CompileStack())
    stats = accelerator.compile_report()["modules"]["CompileStack"]
    assert stats["calls"] == CHECK_AFTER_STEPS and stats["compiled"] is False
    assert len(caught) == 1 and "ran eager every time" in str(caught[0].message)


def test_check_leaves_the_step_plan_and_the_hooks():
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    model = CompileStack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    watched_step = accelerator.step_plan.optimizer_step
    assert model._forward_pre_hooks and model._forward_hooks
    for _ in range(CHECK_AFTER_STEPS):
        accelerator.backward(model(torch.randn(4, 8)).sum())
        optimizer.step()
        optimizer.zero_grad()
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert optimizer.plan is accelerator.step_plan
    assert accelerator.step_plan.optimizer_step is not watched_step
    assert accelerator.step_plan.optimizer_step.__qualname__ != watched_step.__qualname__


def test_recompilations_after_the_check_are_counted_and_warned_once():
    verifier = CompileVerifier(on_done=lambda: None, check_after_steps=1, recompile_warn_threshold=2)
    model = torch.compile(LinearBlock(), backend="eager", dynamic=False)
    verifier.watch(model, "Block")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(1, 8))
        verifier.wrap_optimizer_step(lambda _: True)(None)
        assert verifier.report()["modules"]["Block"]["compiled"] is True
        for batch in range(2, 6):  # a new static shape each time: one recompilation each
            model(torch.randn(batch, 8))
    verifier.close()
    assert verifier.report()["recompiles_after_check"] == 4
    assert [w for w in caught if "did not run" in str(w.message)] == []
    assert len([w for w in caught if "recompilations" in str(w.message)]) == 1
    model(torch.randn(7, 8))  # closed: no longer counted
    assert verifier.recompiles_after_check == 4


def test_no_compile_no_report():
    accelerator = Accelerator(cpu=True)
    _train(accelerator, CompileStack())
    assert accelerator.compile_report() == {"checked": False, "recompiles_after_check": 0, "modules": {}}


def test_a_forward_that_raises_leaves_no_profiler_running():
    verifier = CompileVerifier(on_done=lambda: None)
    model = torch.compile(LinearBlock(), backend="eager")
    verifier.watch(model, "Block")
    with pytest.raises(RuntimeError):
        model(torch.randn(4, 3))  # wrong feature size
    assert not torch.autograd._profiler_enabled()
    model(torch.randn(4, 8))
    assert verifier.report()["modules"]["Block"]["compiled_calls"] == 1


def test_a_model_prepared_after_the_verdict_gets_its_own():
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager"))
    assert _train(accelerator, CompileStack()) == []
    caught = _train(accelerator, CompileStack(), call=lambda compiled: compiled._orig_mod)
    report = accelerator.compile_report()
    assert report["checked"] is True
    assert report["modules"]["CompileStack"]["compiled"] is True and report["modules"]["CompileStack#2"]["compiled"] is False
    assert len(caught) == 1 and "'CompileStack#2'" in str(caught[0].message)


@torch.compiler.disable
def _eager_only(x):
    return x * 2


class EagerBlock(LinearBlock):
    @torch.compiler.disable
    def forward(self, x):
        return torch.relu(self.linear(x))


class CallsEagerOnly(LinearBlock):
    def forward(self, x):
        return _eager_only(self.linear(x))


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([LinearBlock(), EagerBlock(), CallsEagerOnly()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.sum(dim=1, keepdim=True)


def test_uncompilable_code_is_reported_per_region():
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=True))
    caught = _train(accelerator, Mixed())
    modules = accelerator.compile_report()["modules"]
    assert modules["Mixed.blocks.0"]["compiled"] is True and modules["Mixed.blocks.0"]["graph_breaks"] == 0
    assert modules["Mixed.blocks.1"]["compiled"] is False  # torch.compiler.disable on its forward
    assert modules["Mixed.blocks.2"]["graph_breaks"] >= 1  # calls a function dynamo must not trace
    named = {str(w.message).split("'")[1]: str(w.message) for w in caught}
    assert "into no graph" in named["Mixed.blocks.1"]
    assert "graph break" in named["Mixed.blocks.2"] and "Mixed.blocks.0" not in named


def test_check_steps_and_recompile_threshold_come_from_the_dynamo_config():
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(
        backend="eager", dynamic=False, check_after_steps=3, recompile_warn_threshold=0))
    model, optimizer = accelerator.prepare(CompileStack(), torch.optim.SGD(CompileStack().parameters(), lr=0.01))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            if step == 1:  # the default would have given its verdict here
                assert accelerator.compile_report()["checked"] is False
        assert accelerator.compile_report()["modules"]["CompileStack"]["calls"] == 3
        with count_compilation() as counts:
            model(torch.randn(5, 8))  # a new static shape: one recompilation, above the threshold 0
    assert counts.recompiles == 1 and counts.frames == 1
    assert accelerator.compile_report()["recompiles_after_check"] == 1
    assert len([w for w in caught if "1 recompilations" in str(w.message)]) == 1


def test_check_steps_below_one_is_refused_naming_the_key():
    defaults = TorchDynamoPlugin()
    assert (defaults.check_after_steps, defaults.recompile_warn_threshold) == (CHECK_AFTER_STEPS, RECOMPILE_WARN_THRESHOLD)
    with pytest.raises(ValueError, match="check_after_steps"):
        TorchDynamoPlugin(backend="eager", check_after_steps=0)


def test_count_compilation_sees_the_frames_the_accelerator_compiled():
    accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend="eager", use_regional_compilation=True))
    with count_compilation() as counts:
        _train(accelerator, CompileStack(blocks=3))
    assert_compiled(counts, max_recompiles=1, max_graph_breaks=0)
    # Three blocks of one class share one code object: block 0 compiles it, block 1 recompiles it (its
    # input requires grad, block 0's does not) and block 2 hits that second entry.
    assert (counts.frames, counts.compilations, counts.recompiles) == (2, 2, 1)
    with pytest.raises(AssertionError, match="1 recompilation"):
        assert_compiled(counts, max_recompiles=0)
    with pytest.raises(AssertionError, match="at least 3"):
        assert_compiled(counts, min_frames=3)
    with count_compilation() as idle:
        CompileStack()(torch.randn(2, 8))
    with pytest.raises(AssertionError, match="0 frame"):
        assert_compiled(idle)
