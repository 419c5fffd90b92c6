"""FSDP2 x TP (dp_shard 2 x tp 2, 4 gloo ranks) of tiny transformers models from their own plans says
nothing of torchrig's own calls: no "returned a view tensor" from FSDP2 (a gathered column-wise
output — the logits — was ``DTensor.to_local()``'s view) and no "2 sequential all_reduce ...
flatten mesh dimensions" from the gradient norm (reduced once over a flattened sub-mesh) — and it
still trains like one process, with a clipping norm equal on every rank to the last bit. Also with a
plan in torchrig's own style names (its ``output`` style gathers the logits the same way)."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from torchrig.testing.contracts import rank_environment
from torchrig.testing.hf_models import build, make_data
from torchrig.testing.pool import checked_pool

pytestmark = pytest.mark.multiprocess

TIMEOUT = 300
STEPS, PER_RANK, LR, CLIP, DP = 2, 2, 1e-2, 0.5, 2
#: name -> (family, tp_plan): the model's own plan, or torchrig's style names (docs/parallelism.md).
#: qwen3: its q_norm/k_norm gradients summed over tp (replicated_with_grad_allreduce).
TORCHRIG_PLAN = {"model.embed_tokens": "embedding", "model.layers.*.self_attn.[qkv]_proj": "colwise",
                 "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.[gu]*_proj": "colwise",
                 "model.layers.*.mlp.down_proj": "rowwise", "lm_head": "output"}
RUNS = {"llama": ("llama", None), "qwen3": ("qwen3", None), "llama_torchrig_plan": ("llama", TORCHRIG_PLAN)}
#: What torch says about the calls this test is about.
NOISE = ("returned a view tensor", "sequential all_reduce", "flatten mesh dimensions")


def _train(ctx) -> dict:
    from torch.distributed.tensor import _redistribute
    from torchrig import Accelerator, ParallelismConfig

    _redistribute._warned_flatten_issues.clear()  # torch says it once per process: let it say it here
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    torch_logger = logging.getLogger("torch.distributed.tensor._redistribute")
    torch_logger.addHandler(handler)
    results = {}
    try:
        with rank_environment(ctx.rank, ctx.world_size), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for run, (family, tp_plan) in RUNS.items():
                accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=ParallelismConfig(
                    dp_shard_size=DP, tp_size=2, **({"tp_plan": tp_plan} if tp_plan else {})))
                model = build(family)
                optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
                loader = torch.utils.data.DataLoader(make_data(STEPS * PER_RANK * DP), batch_size=PER_RANK)
                model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
                losses, norms = [], []
                for (tokens,) in loader:
                    loss = model(input_ids=tokens, labels=tokens).loss
                    accelerator.backward(loss)
                    norms.append(accelerator.clip_grad_norm_(model.parameters(), CLIP).detach().clone())
                    optimizer.step()
                    optimizer.zero_grad()
                    losses.append(float(loss.detach()))
                params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float()
                          for name, p in accelerator.unwrap_model(model).named_parameters()}
                results[run] = {"losses": losses, "norms": norms, "params": params}
                accelerator.free_memory()
    finally:
        torch_logger.removeHandler(handler)
    results["said"] = [str(w.message) for w in caught] + logged
    return results


def _reference(family: str) -> dict:
    """One process, the data-parallel ranks' batches of a step concatenated."""
    model = build(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(make_data(STEPS * PER_RANK * DP), batch_size=PER_RANK * DP)
    losses, norms = [], []
    for (tokens,) in loader:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "norms": norms, "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def results():
    with checked_pool(4, env={"OMP_NUM_THREADS": "1"}) as pool:
        return pool.run(_train, timeout=TIMEOUT)


def test_torch_says_nothing_about_torchrigs_own_calls(results):
    for rank, result in enumerate(results):
        noisy = [text for text in result["said"] if any(noise in text for noise in NOISE)]
        assert noisy == [], f"rank {rank}: {noisy}"


@pytest.mark.parametrize("run", RUNS)
def test_it_still_trains_like_one_process_with_one_clipping_norm_everywhere(results, run):
    family = RUNS[run][0]
    reference = _reference(family)
    for step, expected in enumerate(reference["norms"]):
        seen = [result[run]["norms"][step] for result in results]
        assert all(torch.equal(norm, seen[0]) for norm in seen), (family, step, seen)  # bit-equal on every rank
        assert float(seen[0]) == pytest.approx(float(expected), rel=1e-4), (family, step)
    for step, expected in enumerate(reference["losses"]):
        mean = sum(results[dp * 2][run]["losses"][step] for dp in range(DP)) / DP
        assert mean == pytest.approx(expected, rel=1e-4, abs=1e-5), (family, step)
    for name, expected in reference["params"].items():
        torch.testing.assert_close(results[0][run]["params"][name], expected, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{run} {name}: {m}")
