"""torch.compile under FSDP2 takes effect (issue 21; Accelerate #4022 ran FSDP2 + regional compile
2.4x slower): on 2 CPU ranks, whole-model and regional compile of the sharded model run compiled
code on every rank, and a compiled module the run bypasses is named in a warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from torchrig.testing.contracts import rank_environment
from torchrig.testing.effects import assert_compiled, count_compilation
from torchrig.testing.models import CompileStack

pytestmark = pytest.mark.multiprocess

TIMEOUT = 180
STEPS = 3


@pytest.fixture
def pool(gloo_pool):
    """The session's 2-rank pool: started once for every module that needs 2 ranks."""
    return gloo_pool


def _train(ctx, regional: bool, bypass: bool = False):
    from torchrig import Accelerator
    from torchrig.config.options import TorchDynamoPlugin

    torch._dynamo.reset()
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", dynamo_plugin=TorchDynamoPlugin(
            backend="eager", use_regional_compilation=regional))
        torch.manual_seed(0)
        model = CompileStack(blocks=2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer = accelerator.prepare(model, optimizer)
        forward = model._orig_mod if bypass else model
        with warnings.catch_warnings(record=True) as caught, count_compilation() as counts:
            warnings.simplefilter("always")
            for _ in range(STEPS):
                accelerator.backward(forward(torch.randn(4, 8)).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
        kinds = sorted({type(p).__name__ for p in model.parameters()})
        return {"report": accelerator.compile_report(), "kinds": kinds, "counts": counts,
                "warnings": [str(w.message) for w in caught if "torch.compile" in str(w.message)]}


def test_whole_model_compile_under_fsdp2_runs_compiled_on_every_rank(pool):
    for result in pool.run(_train, False, timeout=TIMEOUT):
        assert result["kinds"] == ["DTensor"]  # the compiled model is the sharded one
        modules = result["report"]["modules"]
        assert list(modules) == ["FSDPCompileStack"], modules  # named by the prepared (sharded) model's class
        assert modules["FSDPCompileStack"]["compiled"] and modules["FSDPCompileStack"]["compiled_calls"] == modules["FSDPCompileStack"]["calls"] > 0
        assert_compiled(result["counts"], max_recompiles=0)  # dynamo compiled the sharded forward, once
        assert result["warnings"] == []


def test_regional_compile_under_fsdp2_compiles_each_block_on_every_rank(pool):
    for result in pool.run(_train, True, timeout=TIMEOUT):
        modules = result["report"]["modules"]
        assert sorted(modules) == ["FSDPCompileStack.blocks.0", "FSDPCompileStack.blocks.1"]
        assert all(stats["compiled"] and stats["compiled_calls"] == stats["calls"] for stats in modules.values())
        assert_compiled(result["counts"])
        assert result["warnings"] == []


def test_bypassed_compile_under_fsdp2_is_named_on_every_rank(pool):
    for result in pool.run(_train, False, True, timeout=TIMEOUT):
        assert result["report"]["modules"]["FSDPCompileStack"]["compiled"] is False
        assert result["counts"].frames == 0  # nothing was compiled: the wrapper was never called
        assert len(result["warnings"]) == 1 and "'FSDPCompileStack' did not run compiled code" in result["warnings"][0]
