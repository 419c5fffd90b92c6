"""LoRA (peft) under the fsdp strategy. FSDP2 on two gloo ranks: every parameter, the frozen base included, is
sharded; a transformers Llama with trainable adapters trains like one process on the concatenated batches
(accumulation 2, clipping), only the adapters get optimizer state, and ``save_state``/``load_state`` resume
exactly. FSDP2 x TP 2 x 2 on four ranks: the model's own tensor-parallel plan made to follow the adapters
(``torchrig_fsdp.wrapping.adapter_tp_plan``). The workload is torchrig.testing.peft_lora."""

from __future__ import annotations

import gc

import pytest
import torch
from torchrig.testing import peft_lora
from torchrig.testing.contracts import rank_environment

pytestmark = pytest.mark.multiprocess

TIMEOUT = 180
WORLD, PER_RANK, ACCUMULATION, OPTIMIZER_STEPS = 2, 2, 2, 3
MICRO = ACCUMULATION * OPTIMIZER_STEPS
SAMPLES = WORLD * PER_RANK * MICRO * 2  # room for the resumed legs


def _prepared(ctx):
    from torchrig import Accelerator

    gc.collect()  # an earlier task's Accelerator must not hold the world
    accelerator = Accelerator(cpu=True, strategy="fsdp", gradient_accumulation_steps=ACCUMULATION)
    model = peft_lora.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=peft_lora.LR)  # the frozen base included, as users write
    loader = torch.utils.data.DataLoader(peft_lora.make_data(SAMPLES), batch_size=PER_RANK)
    return accelerator, *accelerator.prepare(model, optimizer, loader)


def _train(ctx):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, optimizer, loader = _prepared(ctx)
        result = peft_lora.train(accelerator, model, optimizer, loader, MICRO)
        unwrapped = accelerator.unwrap_model(model)
        trainable = [p for p in unwrapped.parameters() if p.requires_grad]
        with_state = [p for p in unwrapped.parameters() if p in optimizer.state and optimizer.state[p]]
        result.update(strategy=accelerator.strategy, state=peft_lora.full_state(accelerator, model),
                      trainable=len(trainable), with_state=len(with_state),
                      frozen_with_state=sum(not p.requires_grad for p in with_state),
                      unwrapped=type(unwrapped).__name__,
                      placements={name: [str(x) for x in getattr(p, "placements", ())] or type(p).__name__
                                  for name, p in unwrapped.named_parameters()},
                      optimizer_params=sum(len(g["params"]) for g in optimizer.param_groups),
                      optimizer_dtensors=sum(type(p).__name__ == "DTensor" for g in optimizer.param_groups
                                             for p in g["params"]))
        accelerator.end_training()
        return result


def test_lora_under_fsdp2_trains_like_one_process_with_state_for_adapters_only(gloo_pool):
    expected = peft_lora.reference(SAMPLES, WORLD * PER_RANK, ACCUMULATION, stop=MICRO)
    assert max(expected["norms"]) > peft_lora.CLIP  # clipping takes effect
    for rank, result in enumerate(gloo_pool.run(_train, timeout=TIMEOUT)):
        assert result["strategy"] == "fsdp" and result["unwrapped"] in ("PeftModel", "FSDPPeftModel")
        # every parameter, the frozen base included, is a DTensor sharded over the two ranks
        assert all(placements == ["S(0)"] for placements in result["placements"].values()), result["placements"]
        assert result["optimizer_params"] == result["optimizer_dtensors"] == len(result["placements"])
        assert result["trainable"] == len(expected["adapters"]) == expected["optimizer_states"] > 0
        assert result["with_state"] == result["trainable"] and result["frozen_with_state"] == 0
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5, abs=1e-6)
        assert result["norms"] == pytest.approx(expected["norms"], rel=1e-4)
        if rank > 0 and not result["state"]:
            continue  # the full state dict is gathered onto rank 0
        assert result["state"].keys() == expected["state"].keys()
        for name, tensor in expected["state"].items():
            torch.testing.assert_close(result["state"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def _leg(ctx, load_from, save_to, micro):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, optimizer, loader = _prepared(ctx)
        if load_from:
            accelerator.load_state(load_from)
        result = peft_lora.train(accelerator, model, optimizer, loader, micro)
        if save_to:
            accelerator.save_state(save_to)
        result["state"] = peft_lora.full_state(accelerator, model)
        accelerator.end_training()
        return result


def test_lora_under_fsdp2_save_state_load_state_resumes_bit_for_bit(gloo_pool, tmp_path):
    """Train k steps, save, train m more; a fresh run that loads and trains m steps is the same bits."""
    checkpoint = str(tmp_path / "ckpt")
    k, m = 2 * ACCUMULATION, 2 * ACCUMULATION
    gloo_pool.run(_leg, None, checkpoint, k, timeout=TIMEOUT)
    continued = gloo_pool.run(_leg, checkpoint, None, m, timeout=TIMEOUT)
    uninterrupted = gloo_pool.run(_leg, None, None, k + m, timeout=TIMEOUT)
    assert continued[0]["state"]  # rank 0 holds the full state dict
    for rank in range(WORLD):
        assert continued[rank]["losses"] == uninterrupted[rank]["losses"][k:]
        for name, tensor in uninterrupted[rank]["state"].items():
            assert torch.equal(continued[rank]["state"][name], tensor), name


# -- FSDP2 x TP (2 x 2, four ranks) ----------------------------------------------------------------------------


@pytest.fixture
def pool4(gloo_pool4):
    """The session's 4-rank pool: started once for every module that needs 4 ranks."""
    return gloo_pool4


def _train_fsdp2_x_tp(ctx, plan_for_adapters: bool):
    from torchrig import Accelerator, ParallelismConfig
    from torchrig.errors import ConfigError
    from torchrig_fsdp.wrapping import adapter_tp_plan

    with rank_environment(ctx.rank, ctx.world_size):
        gc.collect()
        model = peft_lora.build()
        plan = adapter_tp_plan(model) if plan_for_adapters else None
        accelerator = Accelerator(cpu=True, strategy="fsdp", gradient_accumulation_steps=ACCUMULATION,
                                  parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2, tp_plan=plan))
        optimizer = torch.optim.AdamW(model.parameters(), lr=peft_lora.LR)
        loader = torch.utils.data.DataLoader(peft_lora.make_data(SAMPLES), batch_size=PER_RANK)
        try:
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        except ConfigError as error:
            accelerator.end_training()
            return {"refused": str(error)}
        result = peft_lora.train(accelerator, model, optimizer, loader, MICRO)
        unwrapped = accelerator.unwrap_model(model)
        base_q = unwrapped.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
        result.update(
            state={name: p.full_tensor().detach().float().clone() if hasattr(p, "full_tensor") else p.detach().clone()
                   for name, p in unwrapped.named_parameters()},
            q_placements=[str(x) for x in base_q.base_layer.weight.placements],
            lora_b_placements=[str(x) for x in base_q.lora_B.default.weight.placements],
            with_state=sum(1 for p in unwrapped.parameters() if p in optimizer.state and optimizer.state[p]),
            trainable=sum(p.requires_grad for p in unwrapped.parameters()))
        accelerator.end_training()
        return result


def _assert_fsdp2_x_tp_trains_like_one_process(results):
    expected = peft_lora.reference(SAMPLES, WORLD * PER_RANK, ACCUMULATION, stop=MICRO)
    for result in results:
        assert "refused" not in result, result.get("refused")
        # split over tp (rows), then sharded over dp_shard on top: FSDP2's strided shard of the tp shard
        assert result["q_placements"] == result["lora_b_placements"] == ["_S(0, 2)", "S(0)"]
        assert result["with_state"] == result["trainable"] == len(expected["adapters"])
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5, abs=1e-6)
        assert result["norms"] == pytest.approx(expected["norms"], rel=1e-4)
        for name, tensor in result["state"].items():
            torch.testing.assert_close(tensor, expected["state"][name], rtol=1e-5, atol=1e-6, msg=name)


def test_lora_under_fsdp2_x_tp_with_the_models_own_plan_made_to_follow_the_adapters(pool4):
    """The Llama's own plan names ``model.layers.*.self_attn.q_proj``; under peft that is a LoRA layer at
    ``base_model.model.model.layers.0.self_attn.q_proj`` holding the split Linear as ``base_layer``.
    ``adapter_tp_plan`` follows the adapters (lora_B split with a column-wise layer, lora_A with a row-wise
    one), given as ``tp_plan``: FSDP2 x TP 2 x 2 trains like one process."""
    _assert_fsdp2_x_tp_trains_like_one_process(pool4.run(_train_fsdp2_x_tp, True, timeout=TIMEOUT))


def test_lora_under_fsdp2_x_tp_zero_config_follows_the_adapters(pool4):
    """No tp_plan: the plan the peft-wrapped Llama declares, made to follow the adapters by the strategy."""
    _assert_fsdp2_x_tp_trains_like_one_process(pool4.run(_train_fsdp2_x_tp, False, timeout=TIMEOUT))
