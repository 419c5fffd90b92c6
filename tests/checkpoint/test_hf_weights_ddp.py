"""Hugging Face weights in and out of a DDP-prepared transformers model on 2 gloo ranks (the shared
pool): ``save_pretrained`` files load into every replica bit-exactly (each replica's own shard is
the whole model: it reads each tensor once, no more), and ``save_model`` is written once by the main
process and loads with ``from_pretrained`` bit-identical. Hard timeout; no process left behind."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from torchrig.testing.contracts import rank_environment
from torchrig.testing.hf_models import build

pytestmark = pytest.mark.multiprocess

TIMEOUT = 180


def _ddp_in_and_out(ctx, root: str) -> dict:
    import gc

    from torchrig import Accelerator

    gc.collect()
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="ddp")
        prepared = accelerator.prepare(build("llama_tied", seed=31))
        loaded = accelerator.load_pretrained_weights(prepared, os.path.join(root, "reference"))
        model = accelerator.unwrap_model(prepared)
        written = accelerator.save_model(prepared, os.path.join(root, "saved"), max_shard_size="40KB")
        result = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "written": written,
                  "bytes_read": loaded.bytes_read, "wrapped": type(prepared).__name__}
        accelerator.free_memory()
        return result


def test_hf_weights_load_into_and_save_from_ddp(gloo_pool, tmp_path):
    reference = build("llama_tied", seed=30)
    reference.save_pretrained(tmp_path / "reference", max_shard_size="40KB")
    results = gloo_pool.run(_ddp_in_and_out, str(tmp_path), timeout=TIMEOUT)
    expected = dict(reference.named_parameters())
    total = sum(p.numel() * p.element_size() for p in expected.values())
    for rank, result in enumerate(results):
        assert result["wrapped"] == "DistributedDataParallel"
        assert result["bytes_read"] == total, rank
        for name, value in expected.items():
            assert torch.equal(result["params"][name], value.detach()), f"rank {rank}: {name}"
    assert results[0]["written"] and results[1]["written"] == []
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    for name, value in loaded.named_parameters():
        assert torch.equal(value.detach(), expected[name].detach()), name


def _ddp_adapter(ctx, root: str) -> dict:
    import gc

    import peft
    from torchrig import Accelerator

    gc.collect()
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="ddp")
        lora = peft.get_peft_model(build("llama", seed=32), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                           init_lora_weights=False))
        prepared = accelerator.prepare(lora)
        written = accelerator.save_model(prepared, os.path.join(root, "adapter"))
        adapter = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(lora).items()}
        accelerator.free_memory()
        return {"written": written, "adapter": adapter}


def test_save_model_of_a_ddp_peft_model_writes_the_adapter_once(gloo_pool, tmp_path):
    peft = pytest.importorskip("peft")
    results = gloo_pool.run(_ddp_adapter, str(tmp_path), timeout=TIMEOUT)
    assert set(results[0]["written"]) >= {"adapter_model.safetensors", "adapter_config.json"}
    assert results[1]["written"] == []
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    fresh = peft.PeftModel.from_pretrained(build("llama", seed=32), tmp_path / "adapter")
    loaded = peft.get_peft_model_state_dict(fresh)
    assert set(loaded) == set(results[0]["adapter"])
    for name, value in results[0]["adapter"].items():
        assert torch.equal(loaded[name], value), name
