"""QLoRA on CPU: a transformers Llama loaded 4-bit (bitsandbytes NF4, fp32 compute) with LoRA adapters (peft),
trained through torchrig under DDP, FSDP2 and DeepSpeed ZeRO-3 on two gloo ranks: like one process on the
concatenated batches (accumulation 2, clipping), the base stays quantized and frozen, only the adapters get
optimizer state; ``save_state``/``load_state`` resume bit-for-bit under all three (under ZeRO-3 the module state
DeepSpeed reads back holds bitsandbytes' quantization-state keys, which its strict load used to refuse). The workload is torchrig.testing.peft_lora. bitsandbytes' CPU backend
runs these kernels here (no GPU needed); a model narrower than one quantization block (64) is refused by it."""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from torchrig.testing import peft_lora
from torchrig.testing.contracts import rank_environment

pytest.importorskip("bitsandbytes")
pytestmark = pytest.mark.multiprocess

TIMEOUT = 240
WORLD, PER_RANK, ACCUMULATION, OPTIMIZER_STEPS = 2, 2, 2, 3
MICRO = ACCUMULATION * OPTIMIZER_STEPS
SAMPLES = WORLD * PER_RANK * MICRO * 2
#: ZeRO-3 keeps parameters below this many elements whole on every rank; 0 partitions even a tiny model.
PARTITION_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qlora-base"))
    peft_lora.save_base(directory)
    return directory


def _prepared(base_dir, strategy="ddp"):
    from torchrig import Accelerator

    gc.collect()
    extra = {}
    if strategy == "deepspeed":
        from torchrig_deepspeed.options import DeepSpeedPlugin

        extra["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=3, hf_ds_config=PARTITION_ALL)
    accelerator = Accelerator(cpu=True, strategy=strategy, gradient_accumulation_steps=ACCUMULATION, **extra)
    model = peft_lora.build_qlora(base_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=peft_lora.LR)
    loader = torch.utils.data.DataLoader(peft_lora.make_data(SAMPLES), batch_size=PER_RANK)
    return accelerator, *accelerator.prepare(model, optimizer, loader)


def _adapters(accelerator, model) -> dict[str, torch.Tensor]:
    """The adapters, whole (ZeRO-3 partitions them: gathered through ``get_state_dict``, onto rank 0)."""
    unwrapped = accelerator.unwrap_model(model)
    names = [name for name, p in unwrapped.named_parameters() if p.requires_grad]
    if accelerator.strategy == "deepspeed":
        state = peft_lora.full_state(accelerator, model)
        return {name: state[name] for name in names if name in state}
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for name, p in unwrapped.named_parameters() if p.requires_grad}


def _train(ctx, base_dir, strategy):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, optimizer, loader = _prepared(base_dir, strategy)
        result = peft_lora.train(accelerator, model, optimizer, loader, MICRO)
        unwrapped = accelerator.unwrap_model(model)
        q_proj = unwrapped.get_submodule("base_model.model.model.layers.0.self_attn.q_proj.base_layer")
        if strategy == "deepspeed":  # ZeRO's flat fp32 partitions hold the optimizer state (test_deepspeed_peft.py)
            zero = model.optimizer
            state_of = {id(p): True for group in zero.fp16_groups for p in group}
        else:
            state_of = {id(p): bool(optimizer.state.get(p)) for p in unwrapped.parameters()}
        result.update(strategy=accelerator.strategy, adapters=_adapters(accelerator, model),
                      base=(type(q_proj).__name__, str(q_proj.weight.dtype), q_proj.weight.requires_grad),
                      with_state=sum(1 for p in unwrapped.parameters() if state_of.get(id(p))),
                      frozen_with_state=sum(1 for p in unwrapped.parameters()
                                            if state_of.get(id(p)) and not p.requires_grad))
        accelerator.end_training()
        return result


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed"])
def test_qlora_trains_like_one_process_with_state_for_adapters_only(gloo_pool, base_dir, strategy):
    expected = peft_lora.reference(SAMPLES, WORLD * PER_RANK, ACCUMULATION, stop=MICRO,
                                   make_model=functools.partial(peft_lora.build_qlora, base_dir))
    assert max(expected["norms"]) > peft_lora.CLIP  # clipping takes effect
    results = gloo_pool.run(_train, base_dir, strategy, timeout=TIMEOUT)
    for result in results:
        assert result["strategy"] == strategy
        assert result["base"] == ("Linear4bit", "torch.uint8", False)  # still quantized and frozen
        assert result["with_state"] == len(expected["adapters"]) == expected["optimizer_states"]
        assert result["frozen_with_state"] == 0
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5, abs=1e-6)
        assert result["norms"] == pytest.approx(expected["norms"], rel=1e-4)
        if not result["adapters"]:
            assert strategy == "deepspeed" and result is not results[0]  # ZeRO-3 gathers onto rank 0
            continue
        assert sorted(result["adapters"]) == sorted(expected["adapters"])
        for name, tensor in result["adapters"].items():
            torch.testing.assert_close(tensor, expected["state"][name], rtol=1e-5, atol=1e-6, msg=name)


def _leg(ctx, base_dir, strategy, load_from, save_to, micro):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, optimizer, loader = _prepared(base_dir, strategy)
        if load_from:
            accelerator.load_state(load_from)
        result = peft_lora.train(accelerator, model, optimizer, loader, micro)
        if save_to:
            accelerator.save_state(save_to)
        result["adapters"] = _adapters(accelerator, model)
        accelerator.end_training()
        return result


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed"])
def test_qlora_save_state_load_state_resumes_bit_for_bit(gloo_pool, base_dir, tmp_path, strategy):
    checkpoint = str(tmp_path / "ckpt")
    k, m = 2 * ACCUMULATION, 2 * ACCUMULATION
    gloo_pool.run(_leg, base_dir, strategy, None, checkpoint, k, timeout=TIMEOUT)
    continued = gloo_pool.run(_leg, base_dir, strategy, checkpoint, None, m, timeout=TIMEOUT)
    uninterrupted = gloo_pool.run(_leg, base_dir, strategy, None, None, k + m, timeout=TIMEOUT)
    assert continued[0]["adapters"]
    for rank in range(WORLD):
        assert continued[rank]["losses"] == uninterrupted[rank]["losses"][k:]
        for name, tensor in uninterrupted[rank]["adapters"].items():
            assert torch.equal(continued[rank]["adapters"][name], tensor), name
