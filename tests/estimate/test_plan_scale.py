"""The scale tier (``pytest -m scale``): torchrig plan of Llama-3.1-8B/70B-shaped and Qwen3-MoE-shaped transformers
configs at 64, 256 and 1024 ranks, the main layouts — the multi-GPU code paths (mesh, FSDP2, TP plans, pipeline
split) run at the sizes real runs use, in one CPU process, seconds each. Each asserts no error, the layout the
configuration asks for, and memory that is plausible from first principles (the local shards are the model ÷ the
sharding degrees; activations shrink under activation checkpointing)."""

from __future__ import annotations

import json

import pytest
import yaml
from torchrig.estimate.hardware import gpu_spec
from torchrig.estimate.plan import PlanInputs, PlanTarget, plan_run, recorded_step
from torchrig.estimate.plan_report import failures

pytestmark = pytest.mark.scale

GIB = 1024 ** 3
#: Published shapes (the models' config.json on the Hugging Face hub).
SHAPES = {
    "llama-3.1-8b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "vocab_size": 128256},
    "llama-3.1-70b": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
                      "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "vocab_size": 128256},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                      "num_experts_per_tok": 8, "vocab_size": 151936},
}
PARAMETERS = {"llama-3.1-8b": 8_030_261_248, "llama-3.1-70b": 70_553_706_496}


def plan(tmp_path, shape, world, parallelism, *, seq_len=8192, batch_size=1, step=True, **config):
    model = tmp_path / shape
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(SHAPES[shape]))
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"distributed_type": "FSDP", "mixed_precision": "bf16",
                                   "parallelism_config": parallelism, **config}))
    return plan_run(PlanInputs(model=str(model), batch_size=batch_size, seq_len=seq_len,
                               environment={"TORCHRIG_CONFIG_FILE": str(run)}),
                    PlanTarget(world // 8, 8), recorded_step if step else None)


def collectives(plan_of_rank):
    return {(item.axis, item.kind): item for item in plan_of_rank.step.collectives}


def test_llama_8b_fsdp_on_64_gpus_fits_with_its_shards_a_64th(tmp_path):
    report = plan(tmp_path, "llama-3.1-8b", 64, {"dp_shard_size": 64})
    (rank,) = report.ranks
    assert failures(report, gpu_spec("h100-sxm")) == []
    assert rank.layout.total_parameters == PARAMETERS["llama-3.1-8b"]
    assert PARAMETERS["llama-3.1-8b"] / 64 <= rank.layout.local_parameters < PARAMETERS["llama-3.1-8b"] / 64 * 1.01
    memory = rank.step.memory.by_category
    assert memory["parameters"] == rank.layout.local_parameters * 4  # fp32 master shards
    assert memory["optimizer_state"] >= 2 * memory["parameters"]  # AdamW: two fp32 moments
    gathered = collectives(rank)[("dp_shard", "all_gather")]
    # every block's bf16 parameters gathered in forward and again in backward (the root's once)
    assert 2 * PARAMETERS["llama-3.1-8b"] * 2 * 0.9 < gathered.payload_bytes < 2 * PARAMETERS["llama-3.1-8b"] * 2
    assert rank.step.axes_across_nodes["dp_shard"] is True


def test_llama_8b_hsdp_replicates_across_machines_and_shards_within_one(tmp_path):
    report = plan(tmp_path, "llama-3.1-8b", 64, {"dp_replicate_size": 8, "dp_shard_size": 8})
    (rank,) = report.ranks
    assert rank.error is None and rank.layout.mesh == {"dp_replicate": 8, "dp_shard": 8}
    found = collectives(rank)
    assert ("dp_replicate", "all_reduce") in found and ("dp_shard", "reduce_scatter") in found
    assert rank.step.axes_across_nodes == {**rank.step.axes_across_nodes, "dp_shard": False, "dp_replicate": True}


def test_llama_8b_fsdp_on_1024_gpus(tmp_path):
    report = plan(tmp_path, "llama-3.1-8b", 1024, {"dp_shard_size": 1024})
    (rank,) = report.ranks
    assert rank.error is None and rank.layout.mesh == {"dp_shard": 1024}
    assert rank.layout.local_parameters < PARAMETERS["llama-3.1-8b"] / 1024 * 1.1
    assert collectives(rank)[("dp_shard", "all_gather")].group_size == 1024


def test_llama_70b_fsdp_x_tp_on_256_gpus_with_activation_checkpointing(tmp_path):
    report = plan(tmp_path, "llama-3.1-70b", 256, {"dp_shard_size": 32, "tp_size": 8},
                  fsdp_config={"activation_checkpointing": True})
    (rank,) = report.ranks
    assert failures(report, gpu_spec("h100-sxm")) == []
    assert rank.layout.mesh == {"dp_shard": 32, "tp": 8}
    assert rank.layout.local_parameters < PARAMETERS["llama-3.1-70b"] / 256 * 1.05
    memory = rank.step.memory.by_category
    # checkpointing keeps each block's input only (80 x 8192 x 8192 bf16, not sharded: the model's tp plan has no
    # sequence parallelism) plus the head's fp32 logits (8192 x 128256) and one block recomputed in backward
    block_inputs, logits = 80 * 8192 * 8192 * 2, 8192 * 128256 * 4
    assert block_inputs <= memory["activations"] < block_inputs + logits + 1 * GIB
    found = collectives(rank)
    assert rank.step.axes_across_nodes["tp"] is False and rank.step.axes_across_nodes["dp_shard"] is True
    assert found[("tp", "all_reduce")].group_size == 8 and found[("dp_shard", "all_gather")].group_size == 32


def test_llama_70b_pipeline_x_fsdp_x_tp_on_1024_gpus_plans_every_stage(tmp_path):
    report = plan(tmp_path, "llama-3.1-70b", 1024, {"pp_size": 4, "dp_shard_size": 32, "tp_size": 8},
                  batch_size=4, seq_len=2048)
    assert failures(report, gpu_spec("h100-sxm")) == []
    for rank in report.ranks:  # activations sent forward and their gradients back, per micro-batch
        found = collectives(rank)
        assert ("pp", "send") in found and ("pp", "recv") in found
        assert found[("tp", "all_reduce")].group_size == 8
    peaks = [rank.step.memory.peak_bytes for rank in report.ranks]
    assert peaks[0] > peaks[1]  # 1F1B: the first stage holds the most micro-batches in flight
    assert [rank.layout.coordinates["pp"] for rank in report.ranks] == [0, 2, 3]
    assert [rank.rank for rank in report.ranks] == [0, 512, 768]
    first, middle, last = (rank.layout.local_parameters for rank in report.ranks)
    # 20 of the 80 blocks per stage; the embedding on the first, norm and head on the last
    block_share = (PARAMETERS["llama-3.1-70b"] - 2 * 128256 * 8192) / 4 / 256
    assert block_share <= middle < block_share * 1.01
    assert first > middle and last > middle


def test_a_qwen3_moe_on_64_gpus_shards_its_experts(tmp_path):
    report = plan(tmp_path, "qwen3-30b-a3b", 64, {"dp_shard_size": 64}, seq_len=4096)
    (rank,) = report.ranks
    assert failures(report, gpu_spec("h100-sxm")) == []
    assert 30e9 < rank.layout.total_parameters < 31e9
    # only the routed experts compute: far below the 6·N FLOPs of the dense parameters
    assert sum(rank.step.flops.values()) < 6 * rank.layout.total_parameters * 4096 / 4


def test_context_parallel_lays_out_and_says_its_step_cannot_be_planned_on_cpu(tmp_path):
    report = plan(tmp_path, "llama-3.1-8b", 64, {"dp_shard_size": 8, "cp_size": 8})
    (rank,) = report.ranks
    assert rank.error is None and rank.layout.mesh == {"dp_shard": 8, "cp": 8}
    assert rank.step is None and "cannot be planned on cpu" in rank.unsupported


def test_a_tp_size_the_kv_heads_do_not_divide_is_named_at_256_gpus(tmp_path):
    report = plan(tmp_path, "llama-3.1-70b", 256, {"dp_shard_size": 16, "tp_size": 16}, step=False)
    (rank,) = report.ranks
    assert "parallelism_config.tp_size" in rank.error and "num_key_value_heads is 8" in rank.error
