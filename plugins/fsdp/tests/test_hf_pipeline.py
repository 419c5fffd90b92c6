"""Pipeline stages from a transformers model's own ``base_model_pp_plan`` when the user gives neither
``pp_split_points`` nor ``pp_split_fn``: the plan's layer list split evenly into ``pp_size`` stages
(embeddings on the first, the final norm and ``lm_head`` on the last), names kept, the split logged;
more stages than layers, tied embeddings across stages and extra forward inputs refused by name. Tiny
transformers models (4 layers) of every family — Llama, Qwen3, Gemma (untied), GPT-NeoX, Qwen3-MoE —
trained under PP 2 on 2 gloo ranks match one process (every step's loss and every parameter); Gemma as
it comes (tied) is refused by name."""

from __future__ import annotations

import logging
import os

import pytest
import torch
import transformers
from torchrig.errors import ConfigError
from torchrig.testing.contracts import rank_environment
from torchrig.testing.hf_models import SEQ, build, make_data
from torchrig_fsdp import pp_plan
from torchrig_fsdp.pipeline import build_rank

TIMEOUT = 300
LAYERS, STEPS, PER_RANK, LR, CLIP = 4, 2, 4, 1e-2, 1.0


def _llama(**overrides):
    return build("llama", num_hidden_layers=LAYERS, **overrides)


def _split(model, rank: int, size: int = 2):
    return build_rank(model, rank, size, "1F1B", None, None)


def test_the_split_follows_the_models_pp_plan_names_kept(caplog):
    whole = _llama()
    keys = set(whole.state_dict())
    with caplog.at_level(logging.INFO):
        first_module, [(index, first)], stages = _split(_llama(), 0)
    assert (index, stages) == (0, 2)
    assert "model.embed_tokens, model.layers.0-1" in caplog.text
    assert "model.layers.2-3, model.norm, lm_head" in caplog.text
    _, [(index, last)], _ = _split(_llama(), 1)
    assert index == 1
    last_module = last.model
    first_keys, last_keys = set(first_module.state_dict()), set(last_module.state_dict())
    assert first_keys | last_keys == keys and not first_keys & last_keys  # the unsplit model's names, each once
    assert {k for k in first_keys if not k.startswith("model.layers.")} == {"model.embed_tokens.weight"}
    assert {".".join(k.split(".")[:3]) for k in last_keys if k.startswith("model.layers.")} == \
        {"model.layers.2", "model.layers.3"}
    assert {k for k in last_keys if not k.startswith("model.layers.")} == {"model.norm.weight", "lm_head.weight"}
    # the stages compose to the whole model
    tokens = torch.randint(0, 128, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), whole(input_ids=tokens).logits)


@pytest.mark.parametrize(("family", "overrides"), [
    ("qwen3", {}), ("gemma", {"tie_word_embeddings": False}), ("gpt_neox", {}), ("qwen3_moe", {})])
def test_the_stages_of_each_family_compose_to_the_whole_model(family, overrides):
    """Each family's forward computes rotary embeddings and the causal mask from what a stage receives,
    so the stages split from its own plan, run in turn, give the whole model's logits."""
    whole = build(family, num_hidden_layers=LAYERS, **overrides)
    stages = [build_rank(build(family, num_hidden_layers=LAYERS, **overrides), rank, 2, "1F1B", None, None)[1][0][1]
              for rank in range(2)]
    tokens = torch.randint(0, 128, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(stages[1](stages[0](tokens)), whole(input_ids=tokens).logits)


def test_layers_split_evenly_and_uneven_counts_go_to_the_first_stages():
    assert pp_plan.layer_bounds(4, 2) == [(0, 2), (2, 4)]
    assert pp_plan.layer_bounds(5, 2) == [(0, 3), (3, 5)]
    assert pp_plan.layer_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]


def test_more_stages_than_layers_is_refused_naming_the_counts():
    with pytest.raises(ConfigError) as excinfo:
        _split(build("llama"), 0, 3)  # 2 layers
    text = "\n".join(excinfo.value.problems)
    assert "pp_size is 3 but LlamaForCausalLM has 2 layers (model.layers)" in text
    assert "a stage would be empty" in text and "parallelism_config.pp_size" in text


def test_tied_embeddings_across_stages_are_refused_by_name():
    with pytest.raises(ConfigError) as excinfo:
        _split(build("llama_tied", num_hidden_layers=LAYERS), 0)
    text = "\n".join(excinfo.value.problems)
    assert "model.embed_tokens.weight and lm_head.weight" in text and "tie_word_embeddings=False" in text


def test_a_parameter_outside_the_plans_entries_is_refused_by_name():
    model = _llama()
    model.model.scale = torch.nn.Parameter(torch.ones(()))  # on the base model, in no entry of its plan
    with pytest.raises(ConfigError, match="parameters model.scale are in no entry of its base_model_pp_plan"):
        _split(model, 0)


def test_a_stage_takes_the_token_ids_alone():
    _, [(_, first)], _ = _split(_llama(), 0)
    with pytest.raises(ValueError, match="attention_mask would reach the first stage only"):
        first(torch.randint(0, 128, (2, SEQ)), attention_mask=torch.ones(2, SEQ))
    with pytest.raises(ValueError, match="no token ids were given"):
        first()
    tokens = torch.randint(0, 128, (2, SEQ))
    torch.testing.assert_close(first(input_ids=tokens), first(tokens))  # by keyword too


def test_a_model_without_a_pp_plan_still_needs_a_split():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="nothing says where to split Sequential.*base_model_pp_plan"):
        _split(model, 0)


# -- training on 2 gloo ranks -------------------------------------------------------------------------


@pytest.fixture
def pool2(gloo_pool):
    """The session's 2-rank pool: started once for every module that needs 2 ranks."""
    return gloo_pool


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).float().cpu()


def _data(samples: int) -> torch.utils.data.TensorDataset:
    (tokens,) = make_data(samples)[:]
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])


def _train_pp(ctx, parallelism: dict, dp_size: int, keyword: bool = False, family: str = "llama",
              overrides: dict | None = None, weights: str | None = None) -> dict:
    with rank_environment(ctx.rank, ctx.world_size):
        return _train_stage(parallelism, dp_size, keyword, family, overrides or {}, weights)


def _train_stage(parallelism: dict, dp_size: int, keyword: bool, family: str, overrides: dict,
                 weights: str | None = None) -> dict:
    """Train one stage. With ``weights`` (a directory holding ``reference/``, the one-process model's
    ``save_pretrained``), the stage starts from other random weights, loads the reference into itself
    and after training writes ``saved/`` with ``save_model``."""
    from torchrig import Accelerator
    from torchrig.checkpoint.hf_load import local_bytes

    accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=parallelism)
    model = build(family, seed=5 if weights else 0, num_hidden_layers=LAYERS, **overrides)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(_data(STEPS * PER_RANK * dp_size), batch_size=PER_RANK)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loaded = accelerator.load_pretrained_weights(model, os.path.join(weights, "reference")) if weights else None
    losses = []
    for inputs, labels in loader:
        loss = model(input_ids=inputs, target=labels) if keyword else model(inputs, target=labels)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    plain = accelerator.unwrap_model(model)
    result = {"losses": losses, "params": {n: _full(p) for n, p in plain.named_parameters()},
              "sharded": sorted(n for n, p in plain.named_parameters() if hasattr(p, "placements"))}
    if weights:
        result.update(bytes_read=loaded.bytes_read, local_bytes=local_bytes(plain),
                      written=accelerator.save_model(model, os.path.join(weights, "saved"), max_shard_size="40KB"))
    accelerator.free_memory()
    return result


def _reference(dp_size: int = 1, family: str = "llama", overrides: dict | None = None) -> dict:
    """One process, every data-parallel rank's batch of a step concatenated (same seed, same data)."""
    model = build(family, num_hidden_layers=LAYERS, **(overrides or {}))
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for inputs, labels in torch.utils.data.DataLoader(_data(STEPS * PER_RANK * dp_size), batch_size=PER_RANK * dp_size):
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "initial": initial, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _check(results: list[dict], dp_size: int, family: str = "llama", overrides: dict | None = None) -> None:
    reference = _reference(dp_size, family, overrides)
    trained: dict[str, torch.Tensor] = {}
    for result in results:
        if dp_size == 1:
            assert result["losses"] == pytest.approx(reference["losses"], rel=1e-4, abs=1e-5)
        trained.update(result["params"])
    for step, expected in enumerate(reference["losses"]):  # the mean over the data-parallel ranks
        mean = sum(result["losses"][step] for result in results) / len(results)
        assert mean == pytest.approx(expected, rel=1e-4, abs=1e-5), step
    assert trained.keys() == reference["params"].keys()
    for name, expected in reference["params"].items():
        torch.testing.assert_close(trained[name], expected, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, name=name: f"{family} {name}: {m}")
        assert not torch.equal(expected, reference["initial"][name]), f"{family} {name} did not train"


@pytest.mark.multiprocess
def test_a_transformers_llama_trains_under_pp2_from_its_own_plan_like_one_process(pool2, tmp_path):
    """Also weights in and out of transformers' own stages: each stage loads only its layers' bytes of
    the reference's ``save_pretrained`` files (it starts from other weights, so matching the reference
    proves the load), and ``save_model`` from the two stages writes one model ``from_pretrained`` reads
    bit-exactly as the stages hold it."""
    build("llama", num_hidden_layers=LAYERS).save_pretrained(tmp_path / "reference", max_shard_size="40KB")
    results = pool2.run(_train_pp, {"pp_size": 2}, 1, True, "llama", None, str(tmp_path),
                        timeout=TIMEOUT)  # model(input_ids=..., target=...)
    assert not results[0]["params"].keys() & results[1]["params"].keys()  # each parameter on one stage
    _check(results, 1)
    for result in results:
        assert result["bytes_read"] == result["local_bytes"], "a stage read bytes of the other stage's layers"
    assert results[0]["written"] and results[1]["written"] == []
    saved = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    trained = {**results[0]["params"], **results[1]["params"]}
    assert dict(saved.named_parameters()).keys() == trained.keys()
    for name, value in saved.named_parameters():
        assert torch.equal(value.detach(), trained[name]), name


@pytest.mark.multiprocess
@pytest.mark.parametrize(("parallelism", "dp_size"), [({"pp_size": 2, "tp_size": 2}, 1),
                                                      ({"pp_size": 2, "dp_shard_size": 2}, 2)])
def test_pp2_with_tp2_or_fsdp2_from_the_models_own_plans_like_one_process(gloo_pool4, parallelism, dp_size):
    """4 ranks: the model's own pipeline plan with its own tensor-parallel plan (the other stage's
    ``lm_head``/``embed_tokens`` are no modules there, so the plan's entries for them match nothing), or
    with FSDP2 over each stage."""
    results = gloo_pool4.run(_train_pp, parallelism, dp_size, timeout=TIMEOUT)
    assert all(result["sharded"] for result in results)
    _check(results, dp_size)


#: The other families, trained under PP 2 from their own base_model_pp_plan (Gemma untied: tied, it is refused).
PP_FAMILIES = {"qwen3": {}, "gemma": {"tie_word_embeddings": False}, "gpt_neox": {}, "qwen3_moe": {}}


def _train_families_pp(ctx) -> dict:
    """Every family in turn under PP 2; then Gemma as it comes (tied embeddings), which must be refused."""
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        results = {family: _train_stage({"pp_size": 2}, 1, False, family, overrides)
                   for family, overrides in PP_FAMILIES.items()}
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config={"pp_size": 2})
        try:
            accelerator.prepare(build("gemma", num_hidden_layers=LAYERS))
        except ConfigError as exc:
            results["gemma_tied_refused"] = str(exc)
        accelerator.free_memory()
        return results


@pytest.mark.multiprocess
def test_every_family_trains_under_pp2_from_its_own_plan_like_one_process(pool2):
    """Qwen3, Gemma (untied), GPT-NeoX and Qwen3-MoE, one pooled task: each stage's parameters and every
    step's loss against one process; Gemma with its default tied embeddings refused naming both weights."""
    results = pool2.run(_train_families_pp, timeout=TIMEOUT)
    for family, overrides in PP_FAMILIES.items():
        per_rank = [result[family] for result in results]
        assert not per_rank[0]["params"].keys() & per_rank[1]["params"].keys(), family  # each parameter on one stage
        _check(per_rank, 1, family, overrides)
    for result in results:
        refused = result.get("gemma_tied_refused")
        assert refused is not None, "Gemma's tied embeddings were split across stages without a word"
        assert "model.embed_tokens.weight and lm_head.weight" in refused and "tie_word_embeddings=False" in refused
