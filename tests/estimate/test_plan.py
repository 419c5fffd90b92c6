"""The plan engine (torchrig.estimate.plan): each representative rank of a target world planned in one
process — the real Accelerator and strategy in torch's fake process group, the model on the meta device.
What the real run would raise at prepare is reported by rank; what each rank holds is its real shards."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import yaml
from torchrig.estimate.fake_world import FakeWorldError, fake_world
from torchrig.estimate.plan import PlanInputs, PlanTarget, plan_run, recorded_step, representative_ranks
from torchrig.testing import hf_models


def _plan(tmp_path, parallelism, *, world=16, layers=2, batch_size=1, family="llama", **config):
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    hf_models.config(family, num_hidden_layers=layers).to_json_file(str(model / "config.json"))
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"distributed_type": "FSDP", "parallelism_config": parallelism, **config}))
    return plan_run(PlanInputs(model=str(model), batch_size=batch_size, seq_len=8,
                               environment={"TORCHRIG_CONFIG_FILE": str(run)}), PlanTarget(world // 8, 8))


def test_a_layout_error_of_the_real_run_is_reported_by_rank_with_its_key(tmp_path):
    # LlamaConfig of the test kit: 4 query heads, 2 key/value heads
    report = _plan(tmp_path, {"tp_size": 4, "dp_shard_size": 4})
    (plan,) = report.ranks
    assert plan.layout is None and plan.error is not None
    assert plan.error.startswith("accelerator.prepare(model, optimizer): ConfigError")
    assert "parallelism_config.tp_size" in plan.error and "num_key_value_heads is 2" in plan.error
    assert report.errors == [f"rank 0: {plan.error}"]
    assert not dist.is_initialized()  # the fake world is gone


def test_a_mesh_that_does_not_fill_the_target_world_is_named_before_any_model_exists(tmp_path):
    report = _plan(tmp_path, {"tp_size": 8, "dp_shard_size": 4}, world=16)
    (plan,) = report.ranks
    assert plan.error.startswith("Accelerator(): ConfigError")
    assert "multiply to 32" in plan.error and "world size is 16" in plan.error


def test_an_empty_pipeline_stage_is_named(tmp_path):
    report = _plan(tmp_path, {"tp_size": 2, "dp_shard_size": 2, "pp_size": 4}, layers=2)
    assert "a stage would be empty" in report.ranks[0].error


def test_each_rank_holds_its_real_shards_of_the_target_layout(tmp_path):
    report = _plan(tmp_path, {"tp_size": 2, "dp_shard_size": 8}, world=16)
    (plan,) = report.ranks
    layout = plan.layout
    assert plan.error is None
    assert layout.mesh == {"dp_shard": 8, "tp": 2} and layout.coordinates == {"dp_shard": 0, "tp": 0}
    assert layout.strategy == "fsdp"
    model = hf_models.build("llama")
    assert layout.total_parameters == sum(p.numel() for p in model.parameters())
    # FSDP2 pads each parameter's dim 0 to a multiple of its 8 shards: rank 0 holds ceil(rows / 8) rows
    # of each tensor after tensor parallel split it over 2
    assert layout.local_parameters >= layout.total_parameters // 16
    assert layout.local_parameters < layout.total_parameters // 16 * 1.5
    assert layout.parameter_bytes == {"float32": layout.local_parameters * 4}


def test_pipeline_stages_are_planned_on_their_first_ranks(tmp_path):
    report = _plan(tmp_path, {"tp_size": 2, "dp_shard_size": 2, "pp_size": 4}, layers=4, batch_size=4)
    assert [plan.rank for plan in report.ranks] == [0, 8, 12]
    assert [plan.layout.coordinates["pp"] for plan in report.ranks] == [0, 2, 3]
    assert [plan.layout.role for plan in report.ranks] == ["pp stage 0 of 4", "pp stage 2 of 4", "pp stage 3 of 4"]
    first, middle, last = (plan.layout.local_parameters for plan in report.ranks)
    assert middle < first and middle < last  # the embedding and the head sit on the outer stages


def test_representative_ranks_read_the_mesh_layout():
    import torch

    layout = torch.arange(64).reshape(4, 2, 8)
    assert representative_ranks({"pp": 4, "dp_shard": 2, "tp": 8}, layout) == [0, 32, 48]
    assert representative_ranks({"dp_shard": 8, "tp": 8}, layout.reshape(8, 8)) == [0]


def test_a_fake_world_refuses_a_process_that_has_a_group_and_impossible_shapes():
    with pytest.raises(FakeWorldError, match="multiple of the processes per machine"):
        with fake_world(12, 0, local_world_size=8):
            pass
    with pytest.raises(FakeWorldError, match=r"rank 16 of a world of 16"):
        with fake_world(16, 16, local_world_size=8):
            pass
    with fake_world(16, 3, local_world_size=8):
        assert dist.get_rank() == 3 and dist.get_world_size() == 16
        with pytest.raises(FakeWorldError, match="already has a default process group"):
            with fake_world(16, 0, local_world_size=8):
                pass
    assert not dist.is_initialized()


@pytest.mark.scale  # 7 s: out of the fast tier
def test_expert_parallel_all_to_all_bytes_are_counted_on_the_ep_axis(tmp_path):
    """ep 4 borrowed from dp_shard 8 (MoeLM: 2 MoE layers, 4 experts, top-2, width 32, bf16): per layer the
    forward sends the per-expert counts and the rows to the experts and back (3 all-to-alls), backward the
    two row exchanges again; each row exchange carries every (token, slot) pair, balanced over the experts when
    planned. The experts' FSDP2 traffic runs on efsdp (dp_shard 8 / ep 4), the rest on dp_shard."""
    from torchrig.testing.models import MOE_EXPERTS, MOE_TOP_K, MoeLM

    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"strategy": "fsdp", "mixed_precision": "bf16",
                                   "parallelism_config": {"dp_shard_size": 8, "ep_size": 4}}))
    seq_len = 64
    report = plan_run(PlanInputs(model="torchrig.testing.models:MoeLM", batch_size=1, seq_len=seq_len,
                                 environment={"TORCHRIG_CONFIG_FILE": str(run)}), PlanTarget(1, 8), recorded_step)
    (plan,) = report.ranks
    assert plan.error is None, plan.error
    by_axis = {(summary.axis, summary.kind): summary for summary in plan.step.collectives}
    exchange = by_axis["ep", "all_to_all"]
    layers = len(MoeLM().blocks)
    rows_bytes = seq_len * MOE_TOP_K * 32 * 2  # bf16 rows of width 32
    assert exchange.group_size == 4 and exchange.count == 5 * layers
    assert exchange.payload_bytes == 4 * layers * rows_bytes + layers * MOE_EXPERTS * 8  # rows, the int64 counts
    assert {"efsdp", "dp_shard"} <= {axis for axis, _ in by_axis}
    assert by_axis["efsdp", "all_gather"].group_size == 2
