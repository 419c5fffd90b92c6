"""Expert parallelism on 4 gloo ranks (``parallelism_config.ep_size``), all in one pooled task.

A plain PyTorch MoE (:class:`torchrig.testing.models.MoeLM`, its own ``_ep_plan``) and a transformers
Qwen3-MoE (its ``base_model_ep_plan``, load-balancing loss on) train two AdamW steps under ep 2 x dp_shard 2
and ep 4 x dp_shard 4 (the plain MoE also under HSDP: dp_replicate 2 x dp_shard 2, ep 2) and end where one process ends that trains on the same four per-rank batches (the loss
their mean: the router's load-balancing loss is a per-batch quantity, as under any data parallelism) —
losses, clipped gradient norms and updated parameters. The experts really are split: each rank holds
``1/ep`` of them, ``Shard(0)`` on the ``ep`` axis. Checkpoints: saved under ep 2, resumed by FSDP2 without
EP and saved again, resumed under ep 4 — every parameter and AdamW state tensor equal (``torch.equal``).
"""

from __future__ import annotations

import os

import pytest
import torch
from torchrig.testing.contracts import rank_environment

pytestmark = pytest.mark.multiprocess

TIMEOUT = 300
STEPS, PER_RANK, WORLD = 2, 2, 4
EP2 = {"dp_shard_size": 4, "ep_size": 2}
EP4 = {"dp_shard_size": 4, "ep_size": 4}
NO_EP = {"dp_shard_size": 4}
HSDP_EP2 = {"dp_replicate_size": 2, "dp_shard_size": 2, "ep_size": 2}


def _model(family: str) -> torch.nn.Module:
    if family == "plain":
        from torchrig.testing.models import MoeLM

        torch.manual_seed(0)
        return MoeLM()
    from torchrig.testing.hf_models import build

    return build("qwen3_moe", output_router_logits=True)


def _batches(family: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's batch of every rank: ``[step][rank] -> (tokens, labels)``."""
    if family == "plain":
        from torchrig.testing.models import lm_data

        tokens, labels = lm_data(STEPS * WORLD * PER_RANK)[:]
    else:
        from torchrig.testing.hf_models import make_data

        tokens = labels = make_data(STEPS * WORLD * PER_RANK)[:][0]
    chunks = list(zip(tokens.split(PER_RANK), labels.split(PER_RANK), strict=True))
    return [chunks[step * WORLD:(step + 1) * WORLD] for step in range(STEPS)]


def _loss(family: str, model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(tokens, labels) if family == "plain" else model(input_ids=tokens, labels=labels).loss


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).cpu().clone()


def _snapshot(accelerator, model, optimizer) -> dict:
    params = dict(accelerator.unwrap_model(model).named_parameters())
    state = {f"{name}.{key}": _full(value) for name, param in params.items()
             for key, value in optimizer.state.get(param, {}).items()}
    return {"params": {name: _full(param) for name, param in params.items()}, "optimizer": state}


def _session(family: str, parallelism: dict, *, train: bool, load_from: str | None = None,
             save_to: str | None = None) -> dict:
    from torchrig import Accelerator

    accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=parallelism)
    model = _model(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    plain = accelerator.unwrap_model(model)
    result: dict = {"losses": [], "norms": []}
    experts = [(name, param) for name, param in plain.named_parameters() if ".experts." in name]
    result["layout"] = {(param.device_mesh.mesh_dim_names, tuple(param.device_mesh.shape), repr(param.placements[-1]))
                        for _, param in experts}
    result["num_experts"] = {name: module.num_experts for name, module in plain.named_modules()
                             if name.endswith(".experts")}
    if load_from is not None:
        accelerator.load_state(load_from)
        result["loaded"] = _snapshot(accelerator, model, optimizer)
    if train:
        rank = accelerator.process_index
        for step in _batches(family):
            loss = _loss(family, model, *step[rank])
            accelerator.backward(loss)
            result["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
            result["losses"].append(float(accelerator.reduce(loss.detach(), reduction="mean")))
        result["trained"] = _snapshot(accelerator, model, optimizer)
    if save_to is not None:
        accelerator.save_state(save_to)
    accelerator.end_training()
    return result


def _runs(ctx, root: str) -> dict:
    a, b = os.path.join(root, "a"), os.path.join(root, "b")
    with rank_environment(ctx.rank, ctx.world_size):
        return {
            "plain_ep2": _session("plain", EP2, train=True, save_to=a),
            "plain_no_ep": _session("plain", NO_EP, train=False, load_from=a, save_to=b),
            "plain_ep4": _session("plain", EP4, train=True, load_from=b),
            "qwen_ep2": _session("qwen3_moe", EP2, train=True),
            "plain_hsdp_ep2": _session("plain", HSDP_EP2, train=True),
        }


def _reference(family: str, rounds: int) -> list[dict]:
    """One process, ``rounds`` times the steps of :func:`_batches`: each step's loss the mean of the four ranks'
    batch losses, clipped to norm 1; each round's losses, norms and parameters."""
    model = _model(family)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    results = []
    for _ in range(rounds):
        losses, norms = [], []
        for step in _batches(family):
            loss = sum(_loss(family, model, tokens, labels) for tokens, labels in step) / WORLD
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        results.append({"losses": losses, "norms": norms,
                        "params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return results


def _mismatches(result: dict, reference: dict, what: str) -> list[str]:
    failures = []
    if not torch.allclose(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=1e-5, atol=1e-6):
        failures.append(f"{what}: losses {result['losses']} != {reference['losses']}")
    if not torch.allclose(torch.tensor(result["norms"]), torch.tensor(reference["norms"]), rtol=1e-4, atol=1e-6):
        failures.append(f"{what}: gradient norms {result['norms']} != {reference['norms']}")
    params = result["trained"]["params"]
    assert params.keys() == reference["params"].keys(), what
    wrong = [name for name, value in reference["params"].items()
             if not torch.allclose(params[name], value, rtol=1e-4, atol=1e-5)]
    if wrong:
        failures.append(f"{what}: parameters differ from one process: {wrong}")
    return failures


def _inexact(loaded: dict, saved: dict, what: str) -> list[str]:
    failures = []
    for kind in ("params", "optimizer"):
        assert loaded[kind].keys() == saved[kind].keys(), (what, kind)
        wrong = [name for name, value in saved[kind].items() if not torch.equal(loaded[kind][name], value)]
        if wrong:
            failures.append(f"{what}: {kind} not restored exactly: {wrong}")
    return failures


@pytest.fixture
def pool(gloo_pool4):
    return gloo_pool4


def test_moe_models_train_under_expert_parallel_like_one_process_and_resume_across_ep_layouts(pool, tmp_path):
    results = pool.run(_runs, str(tmp_path), timeout=TIMEOUT)
    first = results[0]
    # the experts are split over ep (Shard(0)), FSDP2-sharded over the rest of dp_shard (efsdp); num_experts local
    assert first["plain_ep2"]["layout"] == {(("efsdp", "ep"), (2, 2), "Shard(dim=0)")}
    assert first["plain_ep4"]["layout"] == {(("efsdp", "ep"), (1, 4), "Shard(dim=0)")}
    assert first["qwen_ep2"]["layout"] == {(("efsdp", "ep"), (2, 2), "Shard(dim=0)")}
    assert first["plain_no_ep"]["layout"] == {(("dp_shard",), (4,), "Shard(dim=0)")}
    assert set(first["plain_ep2"]["num_experts"].values()) == set(first["qwen_ep2"]["num_experts"].values()) == {2}
    assert set(first["plain_ep4"]["num_experts"].values()) == {1}
    assert set(first["plain_no_ep"]["num_experts"].values()) == {4}
    plain, qwen = _reference("plain", rounds=2), _reference("qwen3_moe", rounds=1)
    failures = _mismatches(first["plain_ep2"], plain[0], "plain MoE, ep 2 x dp_shard 2")
    failures += _mismatches(first["plain_ep4"], plain[1], "plain MoE, ep 4 (resumed)")
    failures += _mismatches(first["qwen_ep2"], qwen[0], "Qwen3-MoE, ep 2 x dp_shard 2")
    # HSDP: the experts replicated over dp_replicate, Shard(0) over ep (all of dp_shard), efsdp of one rank
    assert first["plain_hsdp_ep2"]["layout"] == {(("dp_replicate", "efsdp", "ep"), (2, 1, 2), "Shard(dim=0)")}
    failures += _mismatches(first["plain_hsdp_ep2"], plain[0], "plain MoE, dp_replicate 2 x ep 2 (HSDP)")
    # ep 4 resumes plain_no_ep's checkpoint (plain_ep2's state saved again) and trains a second round
    for rank, result in enumerate(results):
        failures += _inexact(result["plain_no_ep"]["loaded"], first["plain_ep2"]["trained"],
                             f"rank {rank}: ep 2 x dp_shard 2 -> dp_shard 4 without EP")
        failures += _inexact(result["plain_ep4"]["loaded"], first["plain_ep2"]["trained"],
                             f"rank {rank}: dp_shard 4 without EP -> ep 4")
        assert result["plain_ep4"]["losses"] == first["plain_ep4"]["losses"]  # the reduced loss, every rank
    assert not failures, "\n".join(failures)
