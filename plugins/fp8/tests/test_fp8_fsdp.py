"""fp8 under FSDP2 on 2 CPU ranks (emulated): the model is converted before ``fully_shard``, the
converted weights are all-gathered in fp8 (proven by torchao's pre-all-gather hook producing
float8 data and by the all-gathers FSDP issues), the scales are precomputed after each optimizer
step (in the step plan), and the model trains."""

from __future__ import annotations

import pytest
import torch
from fp8_models import ProbedLM, batches, lm_loss
from torchrig.testing.contracts import rank_environment

pytestmark = pytest.mark.multiprocess

TIMEOUT = 240
STEPS = 12


@pytest.fixture
def pool(gloo_pool):
    """The session's 2-rank pool: started once for every module that needs 2 ranks."""
    return gloo_pool


def _train(ctx, recipe: str = "tensorwise", all_gather=None):
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
    from torchrig import Accelerator
    from torchrig.testing.effects import assert_modules_converted, count_collectives
    from torchrig_fp8.convert import conversion_report
    from torchrig_fp8.options import AORecipeKwargs

    gathered: list[str] = []  # dtype of every weight torchao handed FSDP to all-gather
    precomputed: list[int] = []
    original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def spy(self, mesh):  # torchao's signature: FSDP2 inspects it
        inputs, metadata = original(self, mesh)
        gathered.append(str(inputs[0].dtype))
        precomputed.append(int(self._precomputed_scale is not None))
        return inputs, metadata

    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = spy
    try:
        with rank_environment(ctx.rank, ctx.world_size):
            accelerator = Accelerator(cpu=True, strategy="fsdp", mixed_precision="fp8", kwargs_handlers=[
                AORecipeKwargs(emulate=True, recipe=recipe, enable_fsdp_float8_all_gather=all_gather)])
            torch.manual_seed(0)
            model = ProbedLM()
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            model, optimizer = accelerator.prepare(model, optimizer)
            converted = assert_modules_converted(accelerator.unwrap_model(model), Float8Linear, count=9)
            losses = []
            for index, tokens in enumerate(batches(STEPS)):
                if index == STEPS - 1:
                    with count_collectives() as counts:
                        loss = lm_loss(model, tokens)
                        accelerator.backward(loss)
                        optimizer.step()
                        optimizer.zero_grad()
                else:
                    loss = lm_loss(model, tokens)
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(loss.item())
            report = conversion_report(accelerator.unwrap_model(model))
            return {"losses": losses, "gathered": gathered, "precomputed": precomputed, "converted": converted,
                    "report": report, "owner": accelerator.step_plan.owners["optimizer_step"],
                    "collectives": counts.as_dict(),
                    "sharded": type(next(iter(model.parameters()))).__name__}
    finally:
        WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = original


def test_fsdp2_all_gathers_fp8_weights_and_trains(pool):
    for result in pool.run(_train, timeout=TIMEOUT):
        report = result["report"]
        assert report.fsdp_float8_all_gather and report.emulate
        assert len(report.converted) == 9 and list(report.skipped) == ["probe"]
        assert result["sharded"] == "DTensor"
        # torchao's pre-all-gather hook ran for the converted weights on every step and gave FSDP
        # float8 data to all-gather (bf16 would be what a plain FSDP2 bf16 run gathers).
        assert result["gathered"] and set(result["gathered"]) == {"torch.float8_e4m3fn"}
        assert len(result["gathered"]) >= 9 * STEPS
        # after the first optimizer step the scales come precomputed (the step plan's wrapper),
        # not computed inside the all-gather
        assert result["precomputed"][:9] == [0] * 9 and all(result["precomputed"][-9:])
        assert "precision:fp8" in result["owner"]
        assert result["collectives"].get("all_gather", 0) > 0
        assert result["losses"][-1] < result["losses"][0] * 0.7, result["losses"]


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_under_fsdp2_gathers_in_high_precision_and_trains(pool, recipe):
    for result in pool.run(_train, recipe, timeout=TIMEOUT):
        report = result["report"]
        assert not report.fsdp_float8_all_gather and report.recipe == recipe
        assert result["gathered"] == []  # plain weights: FSDP gathers them in bf16
        assert "precision:fp8" not in result["owner"]
        assert result["losses"][-1] < result["losses"][0] * 0.7, result["losses"]


def _train_ddp(ctx):
    from torchao.float8.float8_linear import Float8Linear
    from torchrig import Accelerator
    from torchrig.testing.effects import assert_modules_converted
    from torchrig_fp8.convert import conversion_report
    from torchrig_fp8.options import AORecipeKwargs

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="ddp", mixed_precision="fp8",
                                  kwargs_handlers=[AORecipeKwargs(emulate=True)])
        torch.manual_seed(0)
        model = ProbedLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        assert_modules_converted(accelerator.unwrap_model(model), Float8Linear, count=9)
        losses = []
        for tokens in batches(STEPS, seed=1 + ctx.rank):  # each rank its own data
            loss = lm_loss(model, tokens)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        weight = accelerator.unwrap_model(model).blocks[0].qkv.weight.detach().clone()
        return {"losses": losses, "weight": weight, "wrapper": type(model).__name__,
                "report": conversion_report(accelerator.unwrap_model(model))}


def test_ddp_trains_fp8_with_identical_replicas(pool):
    results = pool.run(_train_ddp, timeout=TIMEOUT)
    for result in results:
        assert result["wrapper"] == "DistributedDataParallel"
        assert not result["report"].fsdp_float8_all_gather  # replicas: nothing is all-gathered
        assert result["losses"][-1] < result["losses"][0] * 0.7, result["losses"]
    assert torch.equal(results[0]["weight"], results[1]["weight"])  # gradients were averaged


def _train_compiled(ctx):
    from torchrig import Accelerator
    from torchrig.config.options import TorchDynamoPlugin
    from torchrig.testing.effects import assert_compiled, count_compilation
    from torchrig_fp8.options import AORecipeKwargs

    torch._dynamo.reset()
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", mixed_precision="fp8",
                                  kwargs_handlers=[AORecipeKwargs(emulate=True)],
                                  dynamo_plugin=TorchDynamoPlugin(backend="aot_eager"))
        torch.manual_seed(0)
        model = ProbedLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        losses = []
        with count_compilation() as counts:
            for tokens in batches(4):
                loss = lm_loss(model, tokens)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.item())
        assert_compiled(counts, min_frames=1)
        return {"losses": losses, "report": accelerator.compile_report()}


def test_fsdp2_fp8_compiles_after_conversion_and_sharding(pool):
    for result in pool.run(_train_compiled, timeout=TIMEOUT):
        (module,) = result["report"]["modules"].values()
        assert module["compiled"] and module["frames"] > 0, result["report"]
        assert result["losses"][-1] < result["losses"][0], result["losses"]


def _save_and_resume(ctx, directory: str):
    from torchrig import Accelerator
    from torchrig_fp8.options import AORecipeKwargs

    def build():
        accelerator = Accelerator(cpu=True, strategy="fsdp", mixed_precision="fp8",
                                  kwargs_handlers=[AORecipeKwargs(emulate=True)])
        torch.manual_seed(0)
        model = ProbedLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        return (accelerator, *accelerator.prepare(model, optimizer))

    def step(accelerator, model, optimizer, tokens):
        loss = lm_loss(model, tokens)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    data = batches(6)
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, optimizer = build()
        for tokens in data[:3]:
            step(accelerator, model, optimizer, tokens)
        accelerator.save_state(directory)
        expected = [step(accelerator, model, optimizer, tokens) for tokens in data[3:]]
        accelerator.end_training()
        del accelerator, model, optimizer
        accelerator, model, optimizer = build()
        accelerator.load_state(directory)
        resumed = [step(accelerator, model, optimizer, tokens) for tokens in data[3:]]
        full = accelerator.get_state_dict(model)
        accelerator.end_training()
        return {"expected": expected, "resumed": resumed,
                "full": {k: (str(v.dtype), tuple(v.shape), type(v).__name__) for k, v in full.items()
                         if k.startswith("blocks.0.qkv")}}


def test_fsdp2_fp8_checkpoint_resumes_exactly_and_exports_plain_weights(pool, tmp_path):
    results = pool.run(_save_and_resume, str(tmp_path / "checkpoint"), timeout=TIMEOUT)
    for result in results:
        assert result["resumed"] == result["expected"], result
    assert results[0]["full"]["blocks.0.qkv.weight"] == ("torch.float32", (96, 32), "Tensor"), results[0]["full"]
