"""The layout a checkpoint records (``torchrig.checkpoint.topology``) and what a resume under another one
compares: descriptions in the log and in refusals, the manifest field's validation, the batch sizes a
data-parallel size change keeps, and re-keying a plain optimizer state by parameter name
(``torchrig.checkpoint.plain``). Multi-process resumes across meshes: plugins/fsdp/tests/test_mesh_resume.py."""

from __future__ import annotations

import pytest
from torchrig.checkpoint import CheckpointError, topology
from torchrig.checkpoint.loading import _one_batch_size
from torchrig.checkpoint.manifest import FORMAT, ManifestProblem, validate
from torchrig.checkpoint.plain import optimizer_by_name


def test_a_layout_is_described_by_its_mesh_axes_or_its_strategy_and_world():
    mesh = {"strategy": "fsdp", "world_size": 4, "mesh": {"dp_replicate": 1, "dp_shard": 2, "tp": 2}}
    assert topology.describe(mesh) == "dp_shard=2 x tp=2"  # axes of size 1 are not a layout
    assert topology.describe({"strategy": "ddp", "world_size": 4, "mesh": None}) == "ddp on 4 processes"
    assert topology.describe({"strategy": None, "world_size": 1}) == "single on 1 process"
    assert topology.changed(mesh, {**mesh, "mesh": {"dp_shard": 4}})
    assert topology.changed({"strategy": "ddp", "world_size": 4}, {"strategy": "fsdp", "world_size": 4})
    assert not topology.changed(mesh, {**mesh, "mesh": {"dp_shard": 2, "tp": 2}})


def test_a_manifest_without_a_layout_is_read_as_its_world_size():
    old = {"world_size": 2, "strategy": "ddp"}
    assert topology.saved(old) == {"strategy": "ddp", "world_size": 2, "mesh": None, "data_parallel_size": 2}


@pytest.mark.parametrize("layout", [[], {"mesh": {"tp": 0}}, {"mesh": {"tp": "2"}}, {"mesh": [2, 2]}])
def test_a_malformed_layout_field_is_named(layout):
    manifest = {"format": FORMAT, "sequence": 1, "world_size": 4, "files": [], "layout": layout}
    with pytest.raises(ManifestProblem, match="field layout must be an object"):
        validate(manifest, "/c/torchrig_checkpoint.json")


def test_another_data_parallel_size_keeps_either_the_per_rank_or_the_global_batch():
    saved = [{"batch_size": 2, "total_batch_size": 4, "dataset_length": 32}]
    # tp=2 x dp=2 -> dp=4 with a halved loader batch: the global batch stayed, the per-rank one is not compared
    assert _one_batch_size(saved, [{"batch_size": 1, "total_batch_size": 4, "dataset_length": 32}]) == (
        [{"total_batch_size": 4, "dataset_length": 32}], [{"total_batch_size": 4, "dataset_length": 32}])
    # the same loader batch: the global batch grows with the data-parallel size
    kept_saved, kept_now = _one_batch_size(saved, [{"batch_size": 2, "total_batch_size": 8, "dataset_length": 32}])
    assert kept_saved == kept_now == [{"batch_size": 2, "dataset_length": 32}]
    # neither stayed: a difference the resume reports
    kept_saved, kept_now = _one_batch_size(saved, [{"batch_size": 3, "total_batch_size": 12, "dataset_length": 32}])
    assert kept_saved != kept_now


def test_a_plain_optimizer_state_is_rekeyed_by_parameter_name():
    state = {"state": {0: {"step": 3}, 2: {"step": 3}},
             "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}]}
    named = optimizer_by_name(state, ["a.weight", "a.bias", "b.weight"], "ckpt: optimizer 0")
    assert named == {"state": {"a.weight": {"step": 3}, "b.weight": {"step": 3}},
                     "param_groups": [{"lr": 0.1, "params": ["a.weight", "a.bias"]},
                                      {"lr": 0.2, "params": ["b.weight"]}]}
    with pytest.raises(CheckpointError, match="ckpt: optimizer 0: the saved optimizer has 3 parameters .* has 2"):
        optimizer_by_name(state, ["a.weight", "a.bias"], "ckpt: optimizer 0")
