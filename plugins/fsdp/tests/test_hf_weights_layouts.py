"""Hugging Face weights in and out of every fsdp-strategy layout, on 4 gloo ranks.

Weights in: ``save_pretrained`` of a reference transformers model (sharded safetensors with an
index), loaded with ``Accelerator.load_pretrained_weights`` into a differently initialised model
already prepared as FSDP2, TP (x a replicate axis), FSDP2 x TP: every parameter, gathered with
``full_tensor()``, equals the reference bit for bit, and each rank read exactly the bytes of its
own shards (counted slice by slice as they are read — on CPU the honest measure: tracemalloc does
not see torch's allocations, and the resident size counts mmapped pages) with no single read
larger than one of its local shards: no rank ever holds a full copy.

Weights out: ``save_model`` from the same layouts, its files written by the ranks in parallel
(each file by one rank, several ranks writing), read back with transformers'
``AutoModelForCausalLM.from_pretrained`` in the test process: bit-identical to the gathered full
state. Every task has a hard timeout; the pool must leave no process behind.
"""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from torchrig.testing.contracts import rank_environment
from torchrig.testing.hf_models import build

pytestmark = pytest.mark.multiprocess

TIMEOUT = 300
FAMILIES = ["llama", "llama_tied", "qwen3"]
#: name -> ParallelismConfig arguments on 4 ranks.
LAYOUTS = {
    "fsdp2": {"dp_shard_size": 4},
    "tp2_x_replicate": {"dp_replicate_size": 2, "tp_size": 2},
    "fsdp2_x_tp2": {"dp_shard_size": 2, "tp_size": 2},
}


@pytest.fixture
def pool4(gloo_pool4):
    """The session's 4-rank pool: started once for every module that needs 4 ranks."""
    return gloo_pool4


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).cpu()


def _largest_local(model) -> int:
    largest = 0
    for value in model.state_dict().values():
        local = value.to_local() if hasattr(value, "to_local") else value
        largest = max(largest, local.numel() * local.element_size())
    return largest


def _in_and_out(ctx, root: str, layout: str) -> dict:
    from torchrig import Accelerator, ParallelismConfig
    from torchrig.checkpoint.hf_load import local_bytes
    from torchrig.checkpoint.parallel_export import parallel_state, save_in_parallel

    results = {}
    with rank_environment(ctx.rank, ctx.world_size):
        for family in FAMILIES:
            accelerator = Accelerator(cpu=True, strategy="fsdp",
                                      parallelism_config=ParallelismConfig(**LAYOUTS[layout]))
            prepared = accelerator.prepare(build(family, seed=11))
            model = accelerator.unwrap_model(prepared)
            loaded = accelerator.load_pretrained_weights(prepared, os.path.join(root, f"reference-{family}"))
            params = {name: _full(p) for name, p in model.named_parameters()}
            sharded = any(hasattr(p, "placements") for p in model.parameters())
            saved = os.path.join(root, f"saved-{layout}-{family}")
            written = accelerator.save_model(prepared, saved, max_shard_size="40KB")
            # the writer save_model used for this layout, called directly: which rank wrote which file
            by_rank = save_in_parallel(model, parallel_state(model), saved + "-direct", max_shard_size="40KB")
            results[family] = {"params": params, "bytes_read": loaded.bytes_read, "local_bytes": local_bytes(model),
                               "largest_read": loaded.largest_read, "largest_local": _largest_local(model),
                               "sharded": sharded, "saved": saved, "written": written,
                               "by_rank": by_rank,
                               "tied": model.lm_head.weight is model.get_input_embeddings().weight}
            accelerator.free_memory()
    return results


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_hf_weights_load_into_and_save_from_each_layout_bit_exactly(pool4, tmp_path, layout):
    references = {}
    for family in FAMILIES:
        references[family] = build(family, seed=4)
        references[family].save_pretrained(tmp_path / f"reference-{family}", max_shard_size="40KB")
        assert (tmp_path / f"reference-{family}" / "model.safetensors.index.json").exists()
    results = pool4.run(_in_and_out, str(tmp_path), layout, timeout=TIMEOUT)
    for family, reference in references.items():
        expected = {name: p.detach() for name, p in reference.named_parameters()}
        full_bytes = sum(p.numel() * p.element_size() for p in expected.values())
        for rank, result in enumerate(results):
            mine = result[family]
            assert mine["sharded"], f"{layout}: the model was not sharded"
            assert mine["tied"] == (family == "llama_tied")
            assert set(mine["params"]) == set(expected)
            for name, value in expected.items():
                assert torch.equal(mine["params"][name], value), f"{layout} {family} rank {rank}: {name} (weights in)"
            # each rank read its own shards' bytes and no more, one slice no larger than a local shard
            assert mine["bytes_read"] == mine["local_bytes"], (layout, family, rank)
            assert mine["bytes_read"] < full_bytes, (layout, family, rank)
            assert mine["largest_read"] <= mine["largest_local"], (layout, family, rank)
        saved = results[0][family]["saved"]
        assert os.path.exists(os.path.join(saved, "model.safetensors.index.json"))
        assert os.path.exists(os.path.join(saved, "config.json"))
        # save_model lists every file on the main process; the ranks wrote the weights files in parallel
        # (each file by one rank, several ranks writing), byte for byte what save_model wrote
        files = sorted(name for name in os.listdir(saved) if name.endswith(".safetensors"))
        assert results[0][family]["written"][:len(files)] == files
        assert all(r[family]["written"] == [] for r in results[1:])
        writers = {name: [rank for rank, r in enumerate(results) if name in r[family]["by_rank"]] for name in files}
        assert all(len(ranks) == 1 for ranks in writers.values()), writers
        assert len({ranks[0] for ranks in writers.values()}) > 1, writers
        for name in files + ["model.safetensors.index.json"]:
            with open(os.path.join(saved, name), "rb") as mine, open(os.path.join(saved + "-direct", name), "rb") as direct:
                assert mine.read() == direct.read(), name
        loaded = transformers.AutoModelForCausalLM.from_pretrained(saved)
        gathered = results[0][family]["params"]
        got = dict(loaded.named_parameters())
        assert set(got) == set(gathered)
        for name, value in gathered.items():
            assert got[name].dtype == value.dtype and torch.equal(got[name].detach(), value), \
                f"{layout} {family}: {name} (weights out)"
        assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) == (family == "llama_tied")


def _moe_in_and_out(ctx, root: str) -> dict:
    from torchrig import Accelerator, ParallelismConfig
    from torchrig.checkpoint.hf_load import local_bytes

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=ParallelismConfig(**LAYOUTS["fsdp2_x_tp2"]))
        prepared = accelerator.prepare(build("qwen3_moe", seed=11))
        model = accelerator.unwrap_model(prepared)
        loaded = accelerator.load_pretrained_weights(prepared, os.path.join(root, "reference"))
        placements = {name: tuple(repr(p) for p in param.placements) for name, param in model.named_parameters()
                      if name.endswith("experts.gate_up_proj")}
        params = {name: _full(p) for name, p in model.named_parameters()}
        accelerator.save_model(prepared, os.path.join(root, "saved"), max_shard_size="40KB")
        result = {"params": params, "bytes_read": loaded.bytes_read, "local_bytes": local_bytes(model),
                  "placements": placements}
        accelerator.free_memory()
        return result


def test_moe_experts_split_with_strided_shards_load_and_save_bit_exactly(pool4, tmp_path):
    """Qwen3-MoE's fused gate/up experts are split over tp as strided shards (gate and up halves
    each split): the local chunk is not one slice of the file's tensor. Reference files: save_model
    of one process (transformers' save_pretrained stores experts one by one, which is refused)."""
    from torchrig import Accelerator

    reference = build("qwen3_moe", seed=4)
    Accelerator(cpu=True).save_model(reference, tmp_path / "reference", max_shard_size="40KB")
    results = pool4.run(_moe_in_and_out, str(tmp_path), timeout=TIMEOUT)
    expected = {name: p.detach() for name, p in reference.named_parameters()}
    for rank, result in enumerate(results):
        assert any("StridedShard" in p[-1] for p in result["placements"].values()), result["placements"]
        for name, value in expected.items():
            assert torch.equal(result["params"][name], value), f"rank {rank}: {name} (weights in)"
        assert result["bytes_read"] == result["local_bytes"], rank
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for name, value in loaded.named_parameters():
        assert torch.equal(value.detach(), expected[name]), f"{name} (weights out)"
