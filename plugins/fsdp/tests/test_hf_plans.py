"""Tensor parallel from a transformers model's own plan (``_tp_plan``/``base_model_tp_plan``), every style.

The declared table (:data:`torchrig_fsdp.hf_styles.TRANSFORMERS_STYLES`) against the installed
transformers' ``ALL_PARALLEL_STYLES`` (a new style fails here), the docs' table against the declared
one, refusals by name; then real transformers models of several families, built from tiny configs,
trained through the fsdp strategy under TP 2 (2 gloo ranks), FSDP2 x TP 2 x 2, HSDP's replicate axis
x TP 2 x 2 and pure HSDP 2 x 2 (4 ranks) against a one-process reference: the losses of every step and every parameter after, gathered with
``full_tensor()``. Several families share one pooled task; every task has a hard timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
import transformers
from torchrig.errors import ConfigError
from torchrig.testing.contracts import rank_environment
from torchrig.testing.hf_models import FAMILIES, build, build_rare, make_data
from torchrig_fsdp import hf_styles, tp_styles
from torchrig_fsdp.mesh import model_plan, resolve_plan

TIMEOUT = 300
STEPS, PER_RANK, LR, CLIP = 3, 2, 1e-2, 1.0
DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "parallelism.md")


def _installed_styles() -> set[str]:
    import transformers.distributed.expert_parallel  # noqa: F401  (registers the expert-parallel styles)
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    return set(ALL_PARALLEL_STYLES.keys())


def test_transformers_is_the_pinned_version():
    pinned = re.search(r"^transformers==(\S+)", open(os.path.join(os.path.dirname(DOCS), "..",
                                                                  "requirements-dev.txt")).read(), re.M)
    assert pinned and pinned.group(1) == transformers.__version__


def test_every_style_of_the_installed_transformers_is_mapped_or_refused():
    installed = _installed_styles()
    assert installed == set(hf_styles.TRANSFORMERS_STYLES), (
        f"transformers {transformers.__version__} styles torchrig does not know: "
        f"{sorted(installed - set(hf_styles.TRANSFORMERS_STYLES))}; no longer there: "
        f"{sorted(set(hf_styles.TRANSFORMERS_STYLES) - installed)} — map or refuse each in torchrig_fsdp/hf_styles.py")
    for name, entry in hf_styles.TRANSFORMERS_STYLES.items():
        assert entry.refused or entry.module or entry.parameter, name


def test_the_docs_table_lists_every_style_as_the_declared_table_does():
    text = open(DOCS).read()
    for name, what in hf_styles.describe():
        assert f"| `{name}` | {what} |" in text, f"docs/parallelism.md: no row for {name!r} saying {what!r}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_own_plan_resolves_to_torch_styles(family):
    model = build(family)
    resolved = resolve_plan(model, model_plan(model), False, "own plan", own=True)
    names = dict(model.named_modules())
    assert resolved and all(name in names for name in resolved)
    assert type(resolved["lm_head"]).__name__ == "ColwiseParallel"
    embedding = "gpt_neox.embed_in" if family == "gpt_neox" else "model.embed_tokens"
    assert type(resolved[embedding]).__name__ == "RowwiseParallel"
    if family == "qwen3_moe":  # the expert weights' own entries, wrapped around the block's style
        experts = resolved["model.layers.0.mlp.experts"]
        assert isinstance(experts, tp_styles.ShardedParameters)
        assert isinstance(experts.then, tp_styles.ExpertsTensorParallel)
        assert set(experts.rules) == {"gate_up_proj", "down_proj"}
    if family.startswith("qwen3"):
        assert isinstance(resolved["model.layers.1.self_attn.k_norm"], tp_styles.ReplicatedSumGradients)


def test_refused_styles_and_impossible_entries_are_errors_naming_the_entry():
    model = build("llama")
    plan = {"model.layers.*.self_attn.q_proj": "mla_kv_a_proj", "model.layers.*.mlp": "ep_dispatch_experts",
            "model.norm": "diagonal", "model.layers.*.mlp.up_proj.weight": "packed_rowwise",
            "model.layers.*.mlp.down_proj": "packed_rowwise", "lm_head": "colwise_gather_output"}
    with pytest.raises(ConfigError) as excinfo:
        resolve_plan(model, plan, True, "LlamaForCausalLM's own tensor-parallel plan", own=True)
    text = str(excinfo.value)
    assert "'model.layers.*.self_attn.q_proj': style 'mla_kv_a_proj' is refused" in text
    assert "'ep_dispatch_experts' is refused: an expert-parallel style" in text and "parallelism_config.ep_size" in text
    assert "unknown style 'diagonal'" in text
    assert "module 'model.layers.0.mlp.up_proj' has no style that runs its forward on local shards" in text
    assert "'packed_rowwise' applies to parameters, and 'model.layers.0.mlp.down_proj' is a module" in text
    assert "parallelism_config.loss_parallel" in text and "'lm_head' is 'colwise_gather_output'" in text


def test_head_counts_must_divide_tp_size_naming_the_config_field():
    model = build("llama")
    sharded = list(resolve_plan(model, model_plan(model), False, "plan", own=True))
    assert hf_styles.check_heads_divide(model, sharded, 2) == []
    (problem,) = hf_styles.check_heads_divide(model, sharded, 4)  # 4 query heads divide, 2 key/value heads do not
    assert "LlamaConfig.num_key_value_heads is 2, not divisible by tp_size 4" in problem
    assert problem.startswith("parallelism_config.tp_size")
    assert len(hf_styles.check_heads_divide(model, sharded, 3)) == 2
    assert hf_styles.check_heads_divide(model, ["model.layers.0.mlp.up_proj"], 3) == []  # heads untouched


# -- training on gloo ranks against one process -------------------------------------------------------


@pytest.fixture
def pool2(gloo_pool):
    """The session's 2-rank pool: started once for every module that needs 2 ranks."""
    return gloo_pool


@pytest.fixture
def pool4(gloo_pool4):
    """The session's 4-rank pool: started once for every module that needs 4 ranks."""
    return gloo_pool4


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).float().cpu()


def _placements(param) -> tuple[str, ...] | None:
    return tuple(repr(p) for p in param.placements) if hasattr(param, "placements") else None


def _train_families(ctx, families: list[str], parallelism: dict, dp_size: int) -> dict:
    """Each family in turn under the fsdp strategy: its own plan applied, STEPS optimizer steps with
    clipping; the losses, every parameter gathered, and what the plan did to a few parameters."""
    from torchrig import Accelerator, ParallelismConfig

    results = {}
    with rank_environment(ctx.rank, ctx.world_size):
        for family in families:
            accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=ParallelismConfig(**parallelism))
            model = build(family)
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            loader = torch.utils.data.DataLoader(make_data(STEPS * PER_RANK * dp_size), batch_size=PER_RANK)
            model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
            losses = []
            for (tokens,) in loader:
                loss = model(input_ids=tokens, labels=tokens).loss
                accelerator.backward(loss)
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(_full(loss)))
            plain = accelerator.unwrap_model(model)
            params = dict(plain.named_parameters())
            embedding = plain.get_input_embeddings().weight
            layout = {name: _placements(p) for name, p in params.items()
                      if name.endswith(("layers.0.self_attn.k_proj.weight", "layers.0.attention.query_key_value.weight",
                                        "layers.0.mlp.experts.gate_up_proj", "layers.0.mlp.experts.down_proj",
                                        "layers.0.self_attn.k_norm.weight", "lm_head.weight"))}
            results[family] = {"losses": losses, "params": {n: _full(p) for n, p in params.items()}, "layout": layout,
                               "tied": plain.lm_head.weight is embedding,
                               "optimizer_params": sum(len(g["params"]) for g in optimizer.param_groups)}
            accelerator.free_memory()
    return results


def _reference(family: str, dp_size: int) -> dict:
    """One process, every data-parallel rank's batch of a step concatenated (same seed, same data)."""
    model = build(family)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = torch.utils.data.DataLoader(make_data(STEPS * PER_RANK * dp_size), batch_size=PER_RANK * dp_size)
    losses = []
    for (tokens,) in loader:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "initial": initial, "tied": model.lm_head.weight is model.get_input_embeddings().weight}


def _check_against_reference(results: list[dict], family: str, dp_size: int, tp_size: int) -> None:
    reference = _reference(family, dp_size)
    for step, expected in enumerate(reference["losses"]):
        mean = sum(results[dp * tp_size][family]["losses"][step] for dp in range(dp_size)) / dp_size
        assert mean == pytest.approx(expected, rel=1e-4, abs=1e-5), (family, step)
    for result in results:
        mine = result[family]
        assert mine["tied"] == reference["tied"], f"{family}: the tie of lm_head and the embedding did not survive"
        assert set(mine["params"]) == set(reference["params"])
        for name, expected in reference["params"].items():
            # Adam divides by sqrt(v): a gradient near 0 turns fp32 reduction-order noise into ~1e-5 moves,
            # while a wrong gradient moves a parameter by ~LR per step
            torch.testing.assert_close(mine["params"][name], expected, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, name=name: f"{family} {name}: {m}")
            assert not torch.equal(expected, reference["initial"][name]), f"{family} {name} did not train"


#: The layouts each family trains under: (parallelism_config, data-parallel size, tp size, world).
LAYOUTS = {
    "tp2": ({"tp_size": 2}, 1, 2, 2),
    "fsdp2xtp": ({"dp_shard_size": 2, "tp_size": 2}, 2, 2, 4),
    # HSDP's replicate axis x TP (a shard axis of 1: a real HSDP x TP mesh needs 8 ranks)
    "replicate_x_tp": ({"dp_replicate_size": 2, "tp_size": 2}, 2, 2, 4),
    # pure HSDP: tp 1, so the model's own plan is not used; 4 data-parallel ranks
    "hsdp": ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4, 1, 4),
}

#: What the tp axis (the last mesh dim) does to a few parameters under the model's own plan.
_TP_PLACEMENTS = (("k_proj.weight", "Shard(dim=0)"), ("query_key_value.weight", "Shard(dim=0)"),
                  ("lm_head.weight", "Shard(dim=0)"), ("gate_up_proj", "_StridedShard(dim=1, sf=2)"),
                  ("experts.down_proj", "Shard(dim=2)"), ("k_norm.weight", "Replicate()"))


def _check_placements(layout: str, family: str, seen: dict) -> None:
    assert seen, f"{family}: none of the watched parameters found"
    for name, placements in seen.items():
        assert placements is not None, f"{family} {name} was not sharded"
        if layout == "hsdp":  # replicated over the first axis, sharded by FSDP2 along dim 0 over the second
            assert placements == ("Replicate()", "Shard(dim=0)"), (family, name, placements)
            continue
        for suffix, expected in _TP_PLACEMENTS:
            if name.endswith(suffix):
                assert placements[-1] == expected, (family, name, placements)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_family_trains_from_its_own_plan_like_one_process(request, layout):
    parallelism, dp_size, tp_size, world = LAYOUTS[layout]
    pool = request.getfixturevalue(f"pool{world}")
    families = list(FAMILIES)
    results = pool.run(_train_families, families, parallelism, dp_size, timeout=TIMEOUT)
    for family in families:
        _check_against_reference(results, family, dp_size, tp_size)
        _check_placements(layout, family, results[0][family]["layout"])


def _tie_split_differently(ctx) -> str | None:
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config={"tp_size": 2})
        model = build("llama_tied")
        model._tp_plan = {"model.embed_tokens": "embedding_colwise", "lm_head": "colwise_gather_output"}
        try:
            accelerator.prepare(model)
        except ConfigError as exc:
            return str(exc)
        return None


@pytest.mark.multiprocess
def test_a_tied_embedding_split_two_ways_is_refused_naming_both(pool2):
    for message in pool2.run(_tie_split_differently, timeout=TIMEOUT):
        assert message is not None
        assert "model.embed_tokens.weight and lm_head.weight are one tied parameter" in message
        assert "tie_word_embeddings=False" in message


def _refused_heads(ctx) -> str | None:
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config={"tp_size": 4})
        model = build("llama")
        before = model.model.layers[0].self_attn.k_proj.weight
        try:
            accelerator.prepare(model)
        except ConfigError as exc:
            assert model.model.layers[0].self_attn.k_proj.weight is before  # refused before anything was sharded
            return str(exc)
        return None


@pytest.mark.multiprocess
def test_gqa_heads_not_divisible_by_tp_are_refused_before_sharding(pool4):
    for message in pool4.run(_refused_heads, timeout=TIMEOUT):
        assert message is not None and "LlamaConfig.num_key_value_heads is 2, not divisible by tp_size 4" in message


def _train_rare(ctx) -> dict:
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config={"tp_size": 2})
        model = build_rare()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer = accelerator.prepare(model, optimizer)
        losses = []
        for (tokens,) in torch.utils.data.DataLoader(make_data(STEPS * PER_RANK), batch_size=PER_RANK):
            loss = model(tokens)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss))
        plain = accelerator.unwrap_model(model)
        return {"losses": losses, "params": {n: _full(p) for n, p in plain.named_parameters()},
                "layout": {n: _placements(p) for n, p in plain.named_parameters()}}


@pytest.mark.multiprocess
def test_the_rarer_styles_train_like_one_process(pool2):
    """embedding_colwise, packed_colwise on a fused Linear, rowwise_split_input, a parameter entry +
    local_params + all_reduce, replicate and colwise_rep, on a model declaring its own ``_tp_plan``."""
    results = pool2.run(_train_rare, timeout=TIMEOUT)
    model = build_rare()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for (tokens,) in torch.utils.data.DataLoader(make_data(STEPS * PER_RANK), batch_size=PER_RANK):
        loss = model(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    for result in results:
        assert result["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-5)
        for name, expected in model.named_parameters():
            torch.testing.assert_close(result["params"][name], expected.detach(), rtol=1e-4, atol=1e-4,
                                       msg=lambda m, name=name: f"{name}: {m}")
            assert not torch.equal(expected, initial[name]), f"{name} did not train"
    layout = results[0]["layout"]
    assert layout["embed.weight"] == ("Shard(dim=1)",) and layout["gate_up.weight"] == ("_StridedShard(dim=0, sf=2)",)
    assert layout["mix.weight"] == ("Shard(dim=1)",) and layout["block.down.weight"] == ("Shard(dim=1)",)
    assert layout["head.weight"] == ("Shard(dim=0)",) and layout["norm.weight"] is None  # replicate: left whole


@pytest.mark.multiprocess
def test_torchrig_launch_trains_a_transformers_llama_from_its_own_plan(tmp_path):
    """The issue's report, end to end: ``torchrig launch --cpu --num_processes 2 --strategy fsdp`` of a
    script asking ``ParallelismConfig(tp_size=2)`` for a transformers Llama (failed before: "unknown
    style 'colwise_gather_output'")."""
    script = os.path.join(os.path.dirname(__file__), "launch_scripts", "hf_train.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "2", "--strategy", "fsdp",
               "--log_dir", str(tmp_path / "logs"), script, str(tmp_path), "llama", str(STEPS)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, start_new_session=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    launched = torch.load(tmp_path / "result.pt")
    reference = _reference("llama", 1)
    assert launched["losses"] == pytest.approx(reference["losses"], rel=1e-4, abs=1e-5)
    for name, expected in reference["params"].items():
        torch.testing.assert_close(launched["params"][name], expected, rtol=1e-4, atol=1e-4)
