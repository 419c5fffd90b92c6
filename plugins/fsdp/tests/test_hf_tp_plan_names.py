"""A user's own ``parallelism_config.tp_plan`` may use transformers' style names (copied from a model's
``_tp_plan``/``base_model_tp_plan``): the core checks a plan against the names the selected strategy's
manifest declares (``PluginManifest.tp_styles``), never a list of its own, before launch and again in
each worker; the fsdp strategy declares its own names and transformers' (torch-free:
:mod:`torchrig_fsdp.hf_style_names`). A plan from a config file trains on 2 gloo ranks like the model's
own plan and like one process; an unknown name is refused before launch naming the entry and the names."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torchrig.config.options import TP_STYLES, ParallelismConfig
from torchrig.config.resolve import resolve_config
from torchrig.errors import ConfigError
from torchrig.testing import make_host
from torchrig.testing.contracts import rank_environment
from torchrig.testing.hf_models import build, make_data
from torchrig_fsdp import hf_style_names, hf_styles
from torchrig_fsdp.manifest import FSDPManifest

TIMEOUT = 300
STEPS, PER_RANK, LR, CLIP = 3, 2, 1e-2, 1.0

#: LlamaForCausalLM's own plan as a user copies it into a file (``model._tp_plan`` and the config's
#: ``base_model_tp_plan`` under ``model.``), with the MLP left whole (so the test can tell whose plan ran).
USER_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": None,
    "lm_head": "colwise_gather_output",
}


def test_the_fsdp_manifest_declares_its_own_and_transformers_style_names():
    assert set(FSDPManifest.tp_styles) == {*TP_STYLES, *hf_styles.TRANSFORMERS_STYLES}
    # the torch-free list of names is the runtime table's, in the same order
    assert hf_style_names.TRANSFORMERS_STYLE_NAMES == tuple(hf_styles.TRANSFORMERS_STYLES)
    for name, reason in hf_style_names.REFUSED_STYLES.items():
        assert hf_styles.TRANSFORMERS_STYLES[name].refused == reason


@pytest.mark.multiprocess
def test_the_manifest_module_stays_torch_free():
    code = ("import sys; import torchrig_fsdp.manifest, torchrig_fsdp.hf_style_names; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def _write(tmp_path, plan: dict, **extra) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"strategy": "fsdp", "num_processes": 2, "use_cpu": True,
                                "parallelism_config": {"tp_size": 2, "tp_plan": plan}, **extra}))
    return str(path)


def _resolve(path: str):
    return resolve_config(make_host(), config_file=path, environ={}, flags={}, default_file=False, warn=False)


def test_a_file_plan_with_transformers_names_validates(tmp_path):
    config = _resolve(_write(tmp_path, USER_PLAN))
    assert config.section_of(ParallelismConfig).tp_plan == USER_PLAN


def test_an_unknown_style_is_refused_naming_the_entry_and_listing_the_names(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        _resolve(_write(tmp_path, {**USER_PLAN, "model.norm": "diagonal"}))
    text = "\n".join(excinfo.value.problems)
    assert "parallelism_config.tp_plan" in text and "'model.norm': unknown style 'diagonal'" in text
    assert "colwise_gather_output" in text and "embedding_rowwise" in text and "output_sp" in text
    assert "strategy 'fsdp'" in text and "run.yaml" in text


def test_a_refused_transformers_style_is_refused_before_launch_with_its_reason(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        _resolve(_write(tmp_path, {**USER_PLAN, "model.layers.*.mlp": "ep_dispatch_experts"}))
    text = "\n".join(excinfo.value.problems)
    assert "'model.layers.*.mlp': style 'ep_dispatch_experts' is refused: an expert-parallel style" in text
    assert "parallelism_config.ep_size" in text


def test_a_strategy_declaring_no_styles_refuses_every_name(tmp_path):
    with pytest.raises(ConfigError) as excinfo:
        _resolve(_write(tmp_path, {"lm_head": "colwise"}, strategy="ddp"))
    assert "tp_plan" in "\n".join(excinfo.value.problems)


@pytest.mark.multiprocess
def test_the_launcher_refuses_an_unknown_style_before_starting_anything(tmp_path):
    path = _write(tmp_path, {**USER_PLAN, "model.norm": "diagonal"})
    script = tmp_path / "never.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-m", "torchrig", "launch", "--config_file", path, str(script)],
                            capture_output=True, text=True, timeout=120, env=env, start_new_session=True)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "'model.norm': unknown style 'diagonal'" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "started").exists()


# -- training on 2 gloo ranks -------------------------------------------------------------------------


@pytest.fixture
def pool2(gloo_pool):
    """The session's 2-rank pool: started once for every module that needs 2 ranks."""
    return gloo_pool


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).float().cpu()


def _train(ctx, config_file: str | None) -> dict:
    """A tiny Llama under TP 2: the plan from ``config_file`` (TORCHRIG_CONFIG_FILE), else its own."""
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        before = os.environ.pop("TORCHRIG_CONFIG_FILE", None)
        if config_file:
            os.environ["TORCHRIG_CONFIG_FILE"] = config_file
        try:
            accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config={"tp_size": 2})
        finally:
            os.environ.pop("TORCHRIG_CONFIG_FILE", None)
            if before is not None:
                os.environ["TORCHRIG_CONFIG_FILE"] = before
        model = build("llama")
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        loader = torch.utils.data.DataLoader(make_data(STEPS * PER_RANK), batch_size=PER_RANK)
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
        result = {"losses": losses, "params": {n: _full(p) for n, p in plain.named_parameters()},
                  "layout": {name: tuple(repr(p) for p in getattr(param, "placements", ()))
                             for name, param in plain.named_parameters()
                             if name in ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight")}}
        accelerator.free_memory()
        return result


def _reference() -> dict:
    model = build("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for (tokens,) in torch.utils.data.DataLoader(make_data(STEPS * PER_RANK), batch_size=PER_RANK):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.multiprocess
def test_a_file_plan_with_transformers_names_trains_like_the_models_own_plan(pool2, tmp_path):
    path = _write(tmp_path, USER_PLAN)
    from_file = pool2.run(_train, path, timeout=TIMEOUT)
    own = pool2.run(_train, None, timeout=TIMEOUT)
    reference = _reference()
    for mine, theirs in zip(from_file, own, strict=True):
        # the file's plan was applied (row-wise embedding, MLP whole), not the model's own (MLP split)
        assert mine["layout"] == {"model.embed_tokens.weight": ("Shard(dim=0)",), "model.layers.0.mlp.up_proj.weight": ()}
        assert theirs["layout"]["model.layers.0.mlp.up_proj.weight"] == ("Shard(dim=0)",)
        assert mine["losses"] == pytest.approx(theirs["losses"], rel=1e-4, abs=1e-5)
        assert mine["losses"] == pytest.approx(reference["losses"], rel=1e-4, abs=1e-5)
        for name, expected in reference["params"].items():
            torch.testing.assert_close(mine["params"][name], theirs["params"][name], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mine["params"][name], expected, rtol=1e-4, atol=1e-4,
                                       msg=lambda m, name=name: f"{name}: {m}")
