"""LoRA (peft) under the deepspeed strategy, ZeRO-3, on two gloo ranks (DeepSpeed's CPU accelerator, the
script's torch AdamW): a transformers Llama with a frozen base and trainable adapters trains like one process on
the concatenated batches (accumulation 2, clipping); only the adapters are in DeepSpeed's parameter groups and
in the torch optimizer's state; ``save_state``/``load_state`` resume exactly. The workload is torchrig.testing.peft_lora."""

from __future__ import annotations

import gc

import pytest
import torch
from torchrig.testing import peft_lora
from torchrig.testing.contracts import rank_environment

pytestmark = pytest.mark.multiprocess

TIMEOUT = 240
WORLD, PER_RANK, ACCUMULATION, OPTIMIZER_STEPS = 2, 2, 2, 3
MICRO = ACCUMULATION * OPTIMIZER_STEPS
SAMPLES = WORLD * PER_RANK * MICRO * 2  # room for the resumed legs
#: ZeRO-3 keeps parameters below this many elements whole on every rank; 0 partitions even a tiny model.
PARTITION_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _prepared(ctx):
    from torchrig import Accelerator
    from torchrig_deepspeed.options import DeepSpeedPlugin

    gc.collect()  # an earlier task's Accelerator must not hold the world
    accelerator = Accelerator(cpu=True, strategy="deepspeed", gradient_accumulation_steps=ACCUMULATION,
                              deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, hf_ds_config=PARTITION_ALL))
    model = peft_lora.build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=peft_lora.LR)  # the frozen base included, as users write
    loader = torch.utils.data.DataLoader(peft_lora.make_data(SAMPLES), batch_size=PER_RANK)
    return accelerator, *accelerator.prepare(model, optimizer, loader)


def _train(ctx):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, optimizer, loader = _prepared(ctx)
        result = peft_lora.train(accelerator, model, optimizer, loader, MICRO)
        unwrapped = accelerator.unwrap_model(model)
        zero = model.optimizer  # DeepSpeed's ZeRO-3 optimizer around the script's torch AdamW
        torch_optimizer = zero.optimizer
        result.update(
            strategy=accelerator.strategy, unwrapped=type(unwrapped).__name__,
            state=peft_lora.full_state(accelerator, model),
            trainable=[n for n, p in unwrapped.named_parameters() if p.requires_grad],
            trainable_numel=sum(p.ds_numel for p in unwrapped.parameters() if p.requires_grad),
            zero_params=sum(len(group) for group in zero.fp16_groups),
            zero_frozen=sum(not p.requires_grad for group in zero.fp16_groups for p in group),
            zero_partition_numel=sum(t.numel() for t in zero.fp32_partitioned_groups_flat),
            torch_state_numel=sum(s["exp_avg"].numel() for s in torch_optimizer.state.values() if s),
            base_partitioned=all(p.ds_tensor.numel() < p.ds_numel for p in unwrapped.parameters()
                                 if not p.requires_grad and p.ds_numel >= WORLD))
        accelerator.end_training()
        return result


def test_lora_under_zero3_trains_like_one_process_with_state_for_adapters_only(gloo_pool):
    expected = peft_lora.reference(SAMPLES, WORLD * PER_RANK, ACCUMULATION, stop=MICRO)
    assert max(expected["norms"]) > peft_lora.CLIP  # clipping takes effect
    results = gloo_pool.run(_train, timeout=TIMEOUT)
    # the fp32 partitions the torch optimizer steps hold the adapters' elements, split over the ranks, nothing more
    assert sum(r["zero_partition_numel"] for r in results) == results[0]["trainable_numel"]
    for rank, result in enumerate(results):
        assert result["strategy"] == "deepspeed" and result["unwrapped"] == "PeftModel"
        assert result["base_partitioned"]  # the frozen base is partitioned over the ranks
        assert result["trainable"] == expected["adapters"]
        assert result["zero_params"] == len(expected["adapters"]) and result["zero_frozen"] == 0
        assert result["torch_state_numel"] == result["zero_partition_numel"]
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


def test_lora_under_zero3_save_state_load_state_resumes(gloo_pool, tmp_path):
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
