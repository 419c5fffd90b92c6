"""Hugging Face safetensors weights in and out of a pipeline stage (``pp_size=2``, 2 gloo ranks).

transformers' causal LMs cannot be split into pipeline stages by the fsdp strategy yet (their
forward does not skip the modules another stage holds), so this uses the pipeline tests' own
torchtitan-style ``PipeLM``: a reference state written as ``model.safetensors`` loads into each
stage with each rank reading only its own stage's bytes (keys compared over the union of the
stages: none is missing or unexpected), and ``save_model`` from the stages writes the whole
model once, bit-identical to the reference. Hard timeout; the pool must leave no process behind.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from torchrig.testing.contracts import rank_environment
from torchrig.testing.models import PipeLM, lm_loss

pytestmark = pytest.mark.multiprocess

TIMEOUT = 180


@pytest.fixture
def pool2(gloo_pool):
    """The session's 2-rank pool: started once for every module that needs 2 ranks."""
    return gloo_pool


def _stage_in_and_out(ctx, root: str) -> dict:
    from torchrig import Accelerator, ParallelismConfig
    from torchrig.checkpoint.hf_load import local_bytes

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=ParallelismConfig(
            pp_size=2, pp_split_points=["layers.2"], pp_loss_fn=lm_loss))
        torch.manual_seed(99)
        prepared = accelerator.prepare(PipeLM())
        stage = accelerator.unwrap_model(prepared)
        loaded = accelerator.load_pretrained_weights(prepared, os.path.join(root, "reference"))
        params = {name: p.detach().clone() for name, p in stage.named_parameters()}
        accelerator.save_model(prepared, os.path.join(root, "saved"))
        return {"params": params, "bytes_read": loaded.bytes_read, "local_bytes": local_bytes(stage),
                "missing": loaded.missing, "unexpected": loaded.unexpected}


def test_a_pipeline_stage_loads_only_its_layers_and_save_model_joins_the_stages(pool2, tmp_path):
    torch.manual_seed(7)
    reference = {name: value.contiguous() for name, value in PipeLM().state_dict().items()}
    (tmp_path / "reference").mkdir()
    save_file(reference, str(tmp_path / "reference" / "model.safetensors"))
    total = sum(t.numel() * t.element_size() for t in reference.values())
    results = pool2.run(_stage_in_and_out, str(tmp_path), timeout=TIMEOUT)
    seen: set[str] = set()
    for rank, result in enumerate(results):
        assert result["params"] and result["missing"] == () and result["unexpected"] == ()
        for name, value in result["params"].items():
            assert torch.equal(value, reference[name]), f"rank {rank}: {name}"
        seen |= set(result["params"])
        assert result["bytes_read"] == result["local_bytes"] < total, rank
    assert seen == set(reference)
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert set(saved) == set(reference)
    for name, value in reference.items():
        assert torch.equal(saved[name], value), name
