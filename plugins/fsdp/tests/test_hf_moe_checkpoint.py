"""``save_state`` -> ``load_state`` of a transformers Qwen3-MoE under tensor parallel restores every value
bit-exactly, in the same layout and across layouts.

Its fused expert projection ``gate_up_proj`` is placed ``_StridedShard(dim=1, sf=2)`` on the tp axis (the
gate half and the up half split part by part): each rank's chunk is two slices of the full tensor, not
one: torch's DCP refused to save it ("overlapping chunks") and its full-state load (``FULL_STATE_DICT``)
sliced it as one block, silently wrong. For both state_dict_types, on 4 gloo ranks in one pool: trained
under HSDP's replicate axis x TP 2 and saved; loaded under FSDP2 x TP 2 x 2 (then trained and saved
again), under the same layout, and back under replicate x TP; and both checkpoints loaded by one process — parameters and AdamW state compared with ``torch.equal``.
"""

from __future__ import annotations

import os

import pytest
import torch
from torchrig.testing.contracts import rank_environment
from torchrig.testing.hf_models import SEQ, VOCAB, build

pytestmark = pytest.mark.multiprocess

TIMEOUT = 300
REPLICATE_X_TP = {"dp_replicate_size": 2, "tp_size": 2}
FSDP_X_TP = {"dp_shard_size": 2, "tp_size": 2}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).cpu().clone()


def _snapshot(accelerator, model, optimizer) -> dict:
    """Every parameter and every AdamW state tensor, gathered whole, keyed by parameter name."""
    plain = accelerator.unwrap_model(model)
    params = dict(plain.named_parameters())
    state = {f"{name}.{key}": _full(value) for name, param in params.items()
             for key, value in optimizer.state[param].items()}
    layout = {name: tuple(repr(p) for p in param.placements) for name, param in params.items()
              if hasattr(param, "placements") and name.endswith("layers.0.mlp.experts.gate_up_proj")}
    return {"params": {name: _full(param) for name, param in params.items()}, "optimizer": state, "layout": layout}


def _session(parallelism: dict, state_dict_type: str, seed: int, load_from: str | None, save_to: str | None,
             allow_world_size_change: bool = False) -> dict:
    """Prepare a Qwen3-MoE seeded ``seed`` (so its weights differ from the saved ones), load ``load_from``
    and snapshot it; then, if ``save_to``, one optimizer step and ``save_state`` with its snapshot."""
    from torchrig import Accelerator
    from torchrig_fsdp.options import FullyShardedDataParallelPlugin

    accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=parallelism,
                              fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type=state_dict_type))
    model = build("qwen3_moe", seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    result = {}
    if load_from is not None:
        accelerator.load_state(load_from, allow_world_size_change=allow_world_size_change)
        result["loaded"] = _snapshot(accelerator, model, optimizer)
    if save_to is not None:
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.save_state(save_to)
        result["saved"] = _snapshot(accelerator, model, optimizer)
    accelerator.end_training()
    return result


def _chain(ctx, root: str, state_dict_type: str) -> dict:
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    with rank_environment(ctx.rank, ctx.world_size):
        return {
            "a": _session(REPLICATE_X_TP, state_dict_type, 0, None, a),
            "a_in_fsdp_x_tp": _session(FSDP_X_TP, state_dict_type, 1, a, b),
            "b_in_fsdp_x_tp": _session(FSDP_X_TP, state_dict_type, 2, b, None),
            "b_in_replicate_x_tp": _session(REPLICATE_X_TP, state_dict_type, 3, b, None),
        }


def _inexact(loaded: dict, saved: dict, what: str) -> list[str]:
    """What ``loaded`` does not hold bit-exactly of ``saved`` (parameters and optimizer state)."""
    failures = []
    for kind in ("params", "optimizer"):
        assert loaded[kind].keys() == saved[kind].keys(), (what, kind)
        wrong = [name for name, value in saved[kind].items() if not torch.equal(loaded[kind][name], value)]
        if wrong:
            failures.append(f"{what}: {kind} not restored bit-exactly: {wrong}")
    return failures


@pytest.fixture
def pool(gloo_pool4):
    """The session's 4-rank pool: started once for every module that needs 4 ranks."""
    return gloo_pool4


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_a_qwen3_moe_checkpoint_restores_every_value_exactly_across_tp_layouts(pool, tmp_path, state_dict_type):
    results = pool.run(_chain, str(tmp_path), state_dict_type, timeout=TIMEOUT)
    saved_a, saved_b = results[0]["a"]["saved"], results[0]["a_in_fsdp_x_tp"]["saved"]
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert saved_a["layout"][gate_up] == ("Replicate()", "Shard(dim=0)", "_StridedShard(dim=1, sf=2)")  # dp_shard 1
    assert saved_b["layout"][gate_up] == ("Shard(dim=0)", "_StridedShard(dim=1, sf=2)")
    assert not torch.equal(saved_a["params"]["lm_head.weight"], saved_b["params"]["lm_head.weight"])  # b trained on
    failures = []
    for rank, result in enumerate(results):
        for key, saved, what in (("a_in_fsdp_x_tp", saved_a, "replicate x tp -> fsdp2 x tp"),
                                 ("b_in_fsdp_x_tp", saved_b, "fsdp2 x tp -> fsdp2 x tp"),
                                 ("b_in_replicate_x_tp", saved_b, "fsdp2 x tp -> replicate x tp")):
            failures += _inexact(result[key]["loaded"], saved, f"rank {rank}: {what}")
    with rank_environment(0, 1):  # one process, no mesh
        failures += _inexact(_session({}, state_dict_type, 4, str(tmp_path / "a"), None, True)["loaded"], saved_a,
                             "replicate x tp -> 1 process")
        failures += _inexact(_session({}, state_dict_type, 5, str(tmp_path / "b"), None, True)["loaded"], saved_b,
                             "fsdp2 x tp -> 1 process")
    assert not failures, "\n".join(failures)
