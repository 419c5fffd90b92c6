"""The fsdp strategy's mesh layout and tensor-parallel plans, without processes: which axes the mesh gets,
how a plan's globs and style names resolve, and the model's own plan (transformers' ``base_model_tp_plan``)."""

from __future__ import annotations

import pytest
import torch
from torchrig.config.options import TP_STYLES, ParallelismConfig
from torchrig.errors import ConfigError
from torchrig.testing.models import TP_PLAN, TP_SP_PLAN, TinyLM
from torchrig_fsdp.mesh import mesh_layout, model_plan, resolve_plan


@pytest.mark.parametrize(("sizes", "world", "layout"), [
    ({"dp_shard_size": 2, "tp_size": 2}, 4, ((2, 2), ("dp_shard", "tp"))),
    ({"tp_size": 4}, 4, ((1, 4), ("dp_shard", "tp"))),
    ({"dp_replicate_size": 2, "dp_shard_size": -1}, 8, ((2, 4), ("dp_replicate", "dp_shard"))),
    ({"dp_replicate_size": 2, "dp_shard_size": 2, "tp_size": 2}, 8, ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))),
    # cp sits between the data axes and tp (torchtitan's order: tp innermost, cp next)
    ({"dp_shard_size": 2, "cp_size": 2, "tp_size": 2}, 8, ((2, 2, 2), ("dp_shard", "cp", "tp"))),
    ({"dp_replicate_size": 2, "cp_size": -1}, 8, ((2, 1, 4), ("dp_replicate", "dp_shard", "cp"))),
])
def test_the_mesh_has_dp_shard_and_every_axis_larger_than_one(sizes, world, layout):
    assert mesh_layout(ParallelismConfig(**sizes), world) == layout


def test_a_layout_that_does_not_fit_names_the_keys():
    with pytest.raises(ConfigError) as excinfo:
        mesh_layout(ParallelismConfig(tp_size=2, cp_size=2, pp_size=2), 4)
    text = "\n".join(excinfo.value.problems)
    assert "multiply to 8 (cp_size=2, tp_size=2, pp_size=2) but the world size is 4" in text
    assert "not available" not in text  # every axis is built now: only the product is wrong


def test_plans_resolve_globs_to_every_matching_module_with_torch_styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    model = TinyLM()
    plan = resolve_plan(model, TP_PLAN, False, "parallelism_config.tp_plan")
    assert sorted(n for n, s in plan.items() if isinstance(s, ColwiseParallel)) == [
        "blocks.0.attn.k", "blocks.0.attn.q", "blocks.0.attn.v", "blocks.0.mlp.up",
        "blocks.1.attn.k", "blocks.1.attn.q", "blocks.1.attn.v", "blocks.1.mlp.up", "head"]
    assert isinstance(plan["embed"], RowwiseParallel) and isinstance(plan["blocks.1.attn.o"], RowwiseParallel)
    sp = resolve_plan(model, TP_SP_PLAN, True, "parallelism_config.tp_plan")
    assert isinstance(sp["norm"], SequenceParallel) and isinstance(sp["blocks.0.norm2"], SequenceParallel)
    assert not sp["head"].use_local_output  # loss parallel keeps the logits sharded for the loss
    assert set(TP_STYLES) <= {*TP_PLAN.values(), *TP_SP_PLAN.values(), "colwise", "rowwise"}


def test_plan_errors_list_every_bad_pattern_and_style():
    with pytest.raises(ConfigError) as excinfo:
        resolve_plan(TinyLM(), {"layers.*.q": "colwise", "head": "diagonal", "norm": None}, False, "my plan")
    text = "\n".join(excinfo.value.problems)
    assert "my plan: 'layers.*.q' matches no module of TinyLM" in text and "blocks.0" in text
    assert "my plan: 'head': unknown style 'diagonal'" in text


def test_a_model_declaring_its_own_plan_is_found():
    class Config:
        base_model_tp_plan = {"blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise"}

    model = TinyLM()
    assert model_plan(model) is None
    model.config = Config()
    assert model_plan(model) == Config.base_model_tp_plan
    inner = torch.nn.Module()
    inner.base = model
    # declared by a submodule: its patterns are relative to it
    assert model_plan(inner) == {"base.blocks.*.mlp.up": "colwise", "base.blocks.*.mlp.down": "rowwise"}

    class ForCausalLM(torch.nn.Module):  # transformers: the config's plan is relative to the base model
        base_model_prefix = "model"

        def __init__(self):
            super().__init__()
            self.model, self.config = TinyLM(), Config()

    head = ForCausalLM()
    plan = model_plan(head)
    assert plan == {"model.blocks.*.mlp.up": "colwise", "model.blocks.*.mlp.down": "rowwise"}
    assert sorted(resolve_plan(head, plan, False, "plan")) == [
        "model.blocks.0.mlp.down", "model.blocks.0.mlp.up", "model.blocks.1.mlp.down", "model.blocks.1.mlp.up"]


def test_async_tp_names_every_reason_it_cannot_run():
    from torchrig_fsdp.async_tp import problems

    assert problems("cuda", 2, compiled=True) == []
    found = problems("cpu", 1, compiled=False)
    assert len(found) == 3 and all(p.startswith("parallelism_config.async_tp: ") for p in found)
    assert "needs a tp axis" in found[0] and "this run is on cpu" in found[1] and "dynamo_config.backend" in found[2]
