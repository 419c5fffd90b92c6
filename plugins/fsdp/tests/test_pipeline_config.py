"""Pipeline parallelism without processes: the ``pp`` axis in the mesh layout, how a model is cut into
stages at ``pp_split_points`` (names kept), and every refusal before or at the start of a run."""

from __future__ import annotations

import json

import pytest
import torch
from torchrig.config.options import ParallelismConfig
from torchrig.config.resolve import resolve_config
from torchrig.errors import ConfigError
from torchrig.testing import make_host
from torchrig.testing.models import PipeLM
from torchrig_fsdp.mesh import mesh_layout
from torchrig_fsdp.pipeline import build_rank, build_stage, prune_optimizer, split_units


def test_pp_is_the_outermost_mesh_axis():
    assert mesh_layout(ParallelismConfig(pp_size=2), 2) == ((2, 1), ("pp", "dp_shard"))
    assert mesh_layout(ParallelismConfig(pp_size=2, dp_shard_size=-1, tp_size=2), 8) == \
        ((2, 2, 2), ("pp", "dp_shard", "tp"))


def test_a_stage_is_the_model_without_the_other_stages_modules_under_the_same_names():
    whole = PipeLM()
    names = [name for name, _, _ in split_units(whole)]
    assert names == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "head"]
    first, last = build_stage(PipeLM(), 0, 2, ["layers.2"], None), build_stage(PipeLM(), 1, 2, ["layers.2"], None)
    keys = set(whole.state_dict())
    assert set(first.state_dict()) | set(last.state_dict()) == keys
    assert not set(first.state_dict()) & set(last.state_dict())
    assert {k.split(".")[0] for k in first.state_dict()} == {"embed", "layers"}
    assert {".".join(k.split(".")[:2]) for k in last.state_dict() if k.startswith("layers")} == {"layers.2", "layers.3"}
    assert last.embed is None and first.head is None
    # the stages compose to the whole model
    torch.manual_seed(0)
    model = PipeLM()
    state = model.state_dict()
    tokens = torch.randint(0, 32, (2, 8))
    stages = [build_stage(PipeLM(), s, 3, ["layers.1", "layers.3"], None) for s in range(3)]
    for stage in stages:
        stage.load_state_dict({k: v for k, v in state.items() if k in stage.state_dict()})
    hidden = tokens
    for stage in stages:
        hidden = stage(hidden)
    torch.testing.assert_close(hidden, model(tokens))


def test_interleaved_ranks_hold_stages_in_loop_order_as_views_of_one_module():
    torch.manual_seed(0)
    whole = PipeLM()
    state = whole.state_dict()
    points = ["layers.1", "layers.2", "layers.3"]
    parts = []
    for rank in range(2):
        torch.manual_seed(0)
        module, stages, num_stages = build_rank(PipeLM(), rank, 2, "Interleaved1F1B", points, None)
        assert num_stages == 4 and [index for index, _ in stages] == [rank, rank + 2]
        # the rank's module keeps its stages' names; each view shares its modules (same parameters)
        assert set(module.state_dict()) == set().union(*(view.state_dict() for _, view in stages))
        for _, view in stages:
            for name, param in view.named_parameters():
                assert param is module.get_parameter(name)
        assert type(stages[0][1]) is PipeLM and module.layers is not stages[0][1].layers  # the container is cloned
        parts.append(dict(stages))
    assert set(parts[0][0].state_dict()) == {k for k in state if k.startswith(("embed.", "layers.0."))}
    assert set(parts[1][3].state_dict()) == {k for k in state if k.startswith(("layers.3.", "norm.", "head."))}
    tokens = torch.randint(0, 32, (2, 8))
    hidden = tokens
    for index in range(4):
        hidden = parts[index % 2][index](hidden)
    torch.testing.assert_close(hidden, whole(tokens))
    with pytest.raises(ConfigError, match="needs a multiple of pp_size \\(2\\), at least 4"):
        build_rank(PipeLM(), 0, 2, "Interleaved1F1B", ["layers.2"], None)


def test_the_optimizer_keeps_only_its_stages_parameters():
    model = PipeLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stage = build_stage(model, 1, 2, ["layers.2"], None)
    prune_optimizer(optimizer, stage)
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in stage.parameters()]


def test_a_split_function_gets_the_model_and_stage_index():
    calls = []

    def split(model, stage, num_stages):
        calls.append((stage, num_stages))
        return model.layers[stage]

    model = PipeLM()
    assert build_stage(model, 1, 2, None, split) is model.layers[1]
    assert calls == [(1, 2)]
    with pytest.raises(ConfigError, match="pp_split_fn: returned list"):
        build_stage(model, 0, 2, None, lambda model, stage, n: [])


@pytest.mark.parametrize(("points", "message"), [
    (None, "pp_size is 2 but nothing says where to split PipeLM"),
    (["layers.9"], "'layers.9' names no module PipeLM can be split at; split points (in order): embed, layers.0"),
    (["embed"], "no stage is empty"),
    (["layers.1", "layers.3"], "2 split point(s) make 3 stages but pp_size is 2"),
])
def test_splits_that_cannot_make_the_stages_are_refused_naming_the_key(points, message):
    with pytest.raises(ConfigError) as excinfo:
        build_stage(PipeLM(), 0, 2, points, None)
    text = "\n".join(excinfo.value.problems)
    assert "parallelism_config.pp_split_points" in text and message in text


def test_parameters_on_the_model_itself_belong_to_no_stage():
    model = PipeLM()
    model.scale = torch.nn.Parameter(torch.ones(()))
    with pytest.raises(ConfigError, match="parameters on the model itself \\(scale\\).*pp_split_fn"):
        build_stage(model, 0, 2, ["layers.2"], None)


def _problems(tmp_path, parallelism: dict, **extra) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"strategy": "fsdp", "num_processes": 4, "parallelism_config": parallelism, **extra}))
    with pytest.raises(ConfigError) as excinfo:
        resolve_config(make_host(), config_file=str(path), environ={}, flags={}, default_file=False, warn=False)
    return "\n".join(excinfo.value.problems)


def test_pipeline_keys_are_checked_before_launch(tmp_path):
    text = _problems(tmp_path, {"dp_shard_size": 4, "pp_split_points": ["layers.2"], "pp_microbatches": 4})
    assert "parallelism_config.pp_split_points" in text and "has no effect with pp_size 1" in text
    assert "parallelism_config.pp_microbatches" in text
    text = _problems(tmp_path, {"pp_size": 2, "dp_shard_size": 2, "pp_split_points": ["layers.1", "layers.2"]})
    assert "2 split point(s) make 3 stages but pp_size is 2" in text and "run.yaml" in text
    text = _problems(tmp_path, {"pp_size": 4, "pp_split_points": ["a", "b", "c"], "pp_schedule": "Zero"})
    assert "parallelism_config.pp_schedule" in text and "GPipe" in text
    text = _problems(tmp_path, {"pp_size": 2, "pp_split_points": ["layers.2"], "pp_schedule": "Interleaved1F1B",
                                "dp_shard_size": 2})
    assert "Interleaved1F1B needs a multiple of pp_size (2), at least 4" in text
    text = _problems(tmp_path, {"pp_size": 2, "pp_split_points": ["layers.2"]}, distributed_type="DDP")
    assert "does not build a pp axis" in text and "use strategy fsdp" in text


def test_a_pipeline_config_from_a_file_resolves(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps({"strategy": "fsdp", "num_processes": 4, "parallelism_config": {
        "pp_size": 2, "dp_shard_size": -1, "pp_split_points": "layers.2", "pp_schedule": "GPipe",
        "pp_microbatches": 4}}))
    config = resolve_config(make_host(), config_file=str(path), environ={}, flags={}, default_file=False, warn=False)
    section = config.section_of(ParallelismConfig)
    assert (section.pp_size, section.pp_split_points, section.pp_schedule, section.pp_microbatches) == \
        (2, ["layers.2"], "GPipe", 4)
