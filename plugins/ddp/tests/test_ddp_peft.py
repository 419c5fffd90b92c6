"""LoRA (peft) under the ddp strategy on two gloo ranks: a transformers Llama with a frozen base and trainable
adapters trains like one process on the concatenated batches (accumulation 2, clipping), only the adapters get
optimizer state, and ``save_state``/``load_state`` resume bit-for-bit. The workload is torchrig.testing.peft_lora."""

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
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
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
                      unwrapped=type(unwrapped).__name__)
        accelerator.end_training()
        return result


def test_lora_under_ddp_trains_like_one_process_with_state_for_adapters_only(gloo_pool):
    expected = peft_lora.reference(SAMPLES, WORLD * PER_RANK, ACCUMULATION, stop=MICRO)
    assert max(expected["norms"]) > peft_lora.CLIP  # clipping takes effect
    for result in gloo_pool.run(_train, timeout=TIMEOUT):
        assert result["strategy"] == "ddp" and result["unwrapped"] == "PeftModel"
        assert result["trainable"] == len(expected["adapters"]) == expected["optimizer_states"] > 0
        assert result["with_state"] == result["trainable"] and result["frozen_with_state"] == 0
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5, abs=1e-6)
        assert result["norms"] == pytest.approx(expected["norms"], rel=1e-4)
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


def test_lora_under_ddp_save_state_load_state_resumes_bit_for_bit(gloo_pool, tmp_path):
    """Train k steps, save, train m more; a fresh run that loads and trains m steps is the same bits."""
    checkpoint = str(tmp_path / "ckpt")
    k, m = 2 * ACCUMULATION, 2 * ACCUMULATION
    gloo_pool.run(_leg, None, checkpoint, k, timeout=TIMEOUT)
    continued = gloo_pool.run(_leg, checkpoint, None, m, timeout=TIMEOUT)
    uninterrupted = gloo_pool.run(_leg, None, None, k + m, timeout=TIMEOUT)
    for rank in range(WORLD):
        assert continued[rank]["losses"] == uninterrupted[rank]["losses"][k:]
        for name, tensor in uninterrupted[rank]["state"].items():
            assert torch.equal(continued[rank]["state"][name], tensor), name
