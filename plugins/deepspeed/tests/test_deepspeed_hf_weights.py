"""``save_model`` from DeepSpeed ZeRO-3 writes what transformers' ``from_pretrained`` reads, bit
for bit; and loading Hugging Face weights into a ZeRO-3 model after ``prepare`` (its parameters
partitioned away from their shapes) is refused naming the remedy (load before ``prepare``).

Two gloo ranks (the shared pool), tiny transformers models built from configs; hard timeouts.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
import transformers
from torchrig.testing.contracts import rank_environment
from torchrig.testing.hf_models import build, make_data

pytestmark = pytest.mark.multiprocess

TIMEOUT = 240
PARTITION_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _save_from_zero3(ctx, root: str, family: str) -> dict:
    from torchrig import Accelerator
    from torchrig.checkpoint.files import CheckpointError
    from torchrig_deepspeed.options import DeepSpeedPlugin

    gc.collect()
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="deepspeed",
                                  deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, hf_ds_config=PARTITION_ALL))
        model = build(family, seed=21)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        (tokens,) = make_data(2, seed=ctx.rank)[:]
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
        partitioned = all(p.numel() == 0 for p in accelerator.unwrap_model(model).parameters())
        state = accelerator.get_state_dict(model)
        saved = os.path.join(root, f"saved-{family}")
        written = accelerator.save_model(model, saved, max_shard_size="40KB")
        refusal = None
        try:
            accelerator.load_pretrained_weights(model, saved)
        except CheckpointError as exc:
            refusal = str(exc)
        accelerator.free_memory()
        return {"state": {k: v.clone() for k, v in state.items()}, "written": written, "saved": saved,
                "partitioned": partitioned, "refusal": refusal}


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_save_model_from_zero3_loads_with_from_pretrained_bit_exactly(gloo_pool, tmp_path, family):
    results = gloo_pool.run(_save_from_zero3, str(tmp_path), family, timeout=TIMEOUT)
    main = results[0]
    assert all(r["partitioned"] for r in results), "ZeRO-3 did not partition the parameters"
    assert "config.json" in main["written"] and results[1]["written"] == []
    loaded = transformers.AutoModelForCausalLM.from_pretrained(main["saved"])
    assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) == (family == "llama_tied")
    params = dict(loaded.named_parameters())
    assert set(params) == {name for name, _ in build(family).named_parameters()}
    for name, value in params.items():
        assert torch.equal(value.detach(), main["state"][name]), name
    for result in results:
        assert result["refusal"] and "shapes differ" in result["refusal"] and "before prepare" in result["refusal"]
