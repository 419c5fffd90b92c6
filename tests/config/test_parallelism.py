"""``parallelism_config`` (the device mesh) as a core section: every source with provenance, Accelerate's names
and keys, and the checks made before any process starts (docs/parallelism.md). Torch-free apart from the
Accelerator-argument mapping."""

from __future__ import annotations

import json

import pytest
from torchrig.config.options import ParallelismConfig, TorchTensorParallelPlugin
from torchrig.config.parallelism import infer_sizes
from torchrig.config.resolve import Layer, Schema, resolve_config
from torchrig.errors import ConfigError
from torchrig.testing import make_host


@pytest.fixture(scope="module")
def host():
    return make_host()


def resolve(host, **kwargs):
    for key, value in (("environ", {}), ("flags", {}), ("default_file", False), ("warn", False)):
        kwargs.setdefault(key, value)
    return resolve_config(host, **kwargs)


def problems(host, **kwargs) -> str:
    with pytest.raises(ConfigError) as excinfo:
        resolve(host, **kwargs)
    return "\n".join(excinfo.value.problems)


def config_file(tmp_path, data) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(data, indent=1))  # JSON is YAML: one key per line, for the line numbers
    return str(path)


def test_sizes_from_a_file_env_flag_and_arguments_with_provenance(host, tmp_path):
    run = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 8,
                                 "parallelism_config": {"dp_shard_size": 4, "tp_plan": {"blocks.*.up": "colwise"}}})
    config = resolve(host, config_file=run, environ={"TORCHRIG_PARALLELISM_CONFIG__TP_SIZE": "2"})
    assert (config["parallelism_config.dp_shard_size"], config["parallelism_config.tp_size"]) == (4, 2)
    assert config.source("parallelism_config.dp_shard_size").layer is Layer.CONFIG_FILE
    assert config.source("parallelism_config.tp_size").layer is Layer.ENV
    assert config.section_of(ParallelismConfig).tp_plan == {"blocks.*.up": "colwise"}
    flagged = resolve(host, config_file=run, flags={"parallelism_config.tp_size": ("2", "--tp_size")})
    assert flagged.source("parallelism_config.tp_size").layer is Layer.FLAG
    argued = resolve(host, arguments={"strategy": "fsdp", "num_processes": 4,
                                      "parallelism_config": ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)})
    assert argued.section_of(ParallelismConfig).sizes["dp_replicate"] == 2


def test_the_launcher_offers_a_flag_per_axis(host):
    from torchrig.launch.cli import build_parser

    parser, _ = build_parser(host)
    text = parser.format_help()
    for flag in ("--dp_replicate_size", "--dp_shard_size", "--tp_size", "--cp_size", "--pp_size"):
        assert flag in text


def test_a_product_that_is_not_the_world_size_names_key_source_and_sizes(host, tmp_path):
    run = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4,
                                 "parallelism_config": {"dp_shard_size": 3, "tp_size": 2}})
    text = problems(host, config_file=run)
    assert "parallelism_config.tp_size" in text and "run.yaml:" in text
    assert "multiply to 6 (dp_shard_size=3, tp_size=2) but the world size is 4" in text


def test_one_minus_one_is_inferred_and_two_are_refused_all_problems_at_once(host, tmp_path):
    assert infer_sizes({"dp_replicate": 1, "dp_shard": -1, "cp": 1, "tp": 2, "pp": 1}, 8)[0]["dp_shard"] == 4
    resolve(host, config_file=config_file(tmp_path, {"strategy": "fsdp", "num_processes": 8,
                                                     "parallelism_config": {"dp_shard_size": -1, "tp_size": 2}}))
    run = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 8, "mixed_precision": "fp17",
                                 "parallelism_config": {"dp_shard_size": -1, "tp_size": -1, "pp_size": 0}})
    text = problems(host, config_file=run)
    assert "-1 is allowed on one axis only; dp_shard_size is -1 already" in text  # tp_size
    assert "parallelism_config.pp_size" in text and "positive integer or -1" in text
    assert "mixed_precision" in text  # every problem of the file, not only the mesh's
    uneven = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 6,
                                    "parallelism_config": {"dp_shard_size": -1, "tp_size": 4}})
    assert "-1 cannot be inferred: the world size 6 is not a multiple" in problems(host, config_file=uneven)


def test_an_axis_the_strategy_does_not_declare_names_strategy_axis_and_alternative(host, tmp_path):
    run = config_file(tmp_path, {"strategy": "ddp", "num_processes": 4,
                                 "parallelism_config": {"dp_replicate_size": 2, "tp_size": 2}})
    text = problems(host, config_file=run)
    assert "parallelism_config.tp_size" in text
    assert "the strategy 'ddp' does not build a tp axis (it declares dp_replicate); use strategy fsdp" in text
    cp = config_file(tmp_path, {"strategy": "ddp", "num_processes": 4,
                                "parallelism_config": {"dp_replicate_size": 2, "cp_size": 2}})
    assert "does not build a cp axis (it declares dp_replicate); use strategy fsdp" in problems(host, config_file=cp)
    # fsdp builds cp (FSDP2 then shards over dp_shard x cp)
    resolve(host, config_file=config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4,
                                                     "parallelism_config": {"dp_shard_size": 2, "cp_size": 2}}))
    # pure data parallelism under ddp is its own axis: accepted
    resolve(host, config_file=config_file(tmp_path, {"strategy": "ddp", "num_processes": 4,
                                                     "parallelism_config": {"dp_replicate_size": 4}}))


def test_unset_sizes_leave_the_strategys_own_layout(host, tmp_path):
    config = resolve(host, config_file=config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4}))
    assert not config.section_of(ParallelismConfig).enabled


def test_fsdp_hybrid_sharding_and_a_mesh_together_are_refused(host, tmp_path):
    run = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4,
                                 "fsdp_config": {"sharding_strategy": "HYBRID_SHARD"},
                                 "parallelism_config": {"dp_replicate_size": 2, "dp_shard_size": 2}})
    assert "both describe the mesh" in problems(host, config_file=run)


def test_a_plan_or_loss_parallel_without_tp_is_refused_not_ignored(host, tmp_path):
    run = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 2, "parallelism_config": {
        "dp_shard_size": 2, "tp_plan": {"head": "output"}, "loss_parallel": True}})
    text = problems(host, config_file=run)
    assert "parallelism_config.tp_plan" in text and "parallelism_config.loss_parallel" in text
    assert "no effect with tp_size 1" in text


def test_fp16_with_tensor_parallel_alone_is_refused(host, tmp_path):
    run = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4, "mixed_precision": "fp16",
                                 "parallelism_config": {"tp_size": 4}})
    assert "mixed_precision" in (text := problems(host, config_file=run)) and "use bf16" in text
    resolve(host, config_file=config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4, "mixed_precision": "fp16",
                                                     "parallelism_config": {"tp_size": 2, "dp_shard_size": 2}}))


def test_dispatch_batches_with_tensor_parallel_is_refused(host, tmp_path):
    run = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4, "dataloader_config": {"dispatch_batches": True},
                                 "parallelism_config": {"dp_shard_size": 2, "tp_size": 2}})
    text = problems(host, config_file=run)
    assert "dataloader_config.dispatch_batches" in text and "tp_size=2" in text


def test_accelerate_file_keys_and_names_map_onto_the_section(host, tmp_path):
    run = config_file(tmp_path, {"distributed_type": "FSDP", "num_processes": 4, "parallelism_config": {
        "parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 2, "parallelism_config_cp_size": 1}})
    config = resolve(host, config_file=run)
    assert config.section_of(ParallelismConfig).sizes == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "pp": 1}
    import torchrig
    import torchrig.utils

    assert torchrig.ParallelismConfig is ParallelismConfig
    assert torchrig.utils.TorchTensorParallelPlugin is TorchTensorParallelPlugin
    with pytest.raises(ImportError, match="context-parallel handler class is not provided"):
        from torchrig.utils import TorchContextParallelConfig  # noqa: F401


def test_accelerator_arguments_take_the_object_a_mapping_or_the_tp_plugin(host):
    from torchrig.accelerator.accelerator import accelerator_arguments

    schema = Schema(host)
    assert accelerator_arguments(schema, torch_tp_plugin=TorchTensorParallelPlugin(tp_size=2)) == {
        "parallelism_config": {"tp_size": 2}}
    given = ParallelismConfig(tp_size=2, dp_shard_size=-1)
    assert accelerator_arguments(schema, parallelism_config=given) == {"parallelism_config": given}
    assert accelerator_arguments(schema, parallelism_config={"tp_size": 2}) == {"parallelism_config": {"tp_size": 2}}
    both = accelerator_arguments(schema, parallelism_config=given, torch_tp_plugin=TorchTensorParallelPlugin(tp_size=4))
    assert both["parallelism_config"].tp_size == 4 and both["parallelism_config"].dp_shard_size == -1
    with pytest.raises(ConfigError) as excinfo:
        accelerator_arguments(schema, torch_tp_plugin={"tp_size": 2}, parallelism_config=3)
    assert "expected a TorchTensorParallelPlugin" in str(excinfo.value) and "expected a ParallelismConfig" in str(excinfo.value)


def test_unknown_tp_style_is_refused_with_the_styles(host, tmp_path):
    run = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 2,
                                 "parallelism_config": {"tp_size": 2, "tp_plan": {"head": "columnwise"}}})
    text = problems(host, config_file=run)
    assert "parallelism_config.tp_plan" in text and "unknown style 'columnwise'" in text and "colwise" in text


def test_context_and_async_tensor_parallel_settings_are_checked_before_launch(host, tmp_path):
    run = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4, "dataloader_config": {"dispatch_batches": True},
                                 "parallelism_config": {"dp_shard_size": 2, "cp_size": 2}})
    text = problems(host, config_file=run)
    assert "dataloader_config.dispatch_batches" in text and "cp_size=2" in text
    alone = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4,
                                   "parallelism_config": {"dp_shard_size": 4, "async_tp": True}})
    assert "parallelism_config.async_tp" in problems(host, config_file=alone)
    assert "has no effect with tp_size 1" in problems(host, config_file=alone)
    on_cpu = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4, "use_cpu": True,
                                    "parallelism_config": {"dp_shard_size": 2, "tp_size": 2, "async_tp": True}})
    text = problems(host, config_file=on_cpu)
    assert "parallelism_config.async_tp" in text and "needs CUDA devices" in text and "use_cpu" in text
    bad = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4,
                                 "parallelism_config": {"cp_size": 4, "cp_comm_strategy": "ring"}})
    assert "parallelism_config.cp_comm_strategy" in problems(host, config_file=bad)
    good = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4,
                                  "parallelism_config": {"cp_size": 2, "tp_size": 2, "cp_comm_strategy": "AllToAll",
                                                         "cp_load_balance": False}})
    options = resolve(host, config_file=good).section_of(ParallelismConfig)
    assert (options.cp_comm_strategy, options.cp_load_balance) == ("alltoall", False)


def test_expert_parallel_size_is_checked_before_launch_naming_the_keys(host, tmp_path):
    """``ep_size`` is borrowed from ``dp_shard`` (not a factor of the world size): it must divide
    ``dp_shard_size``; a strategy without an ep axis, and the axes EP does not compose with yet, are refused."""
    ok = resolve(host, config_file=config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4,
                                                          "parallelism_config": {"dp_shard_size": 4, "ep_size": 2}}))
    assert ok.section_of(ParallelismConfig).ep_size == 2 and ok.section_of(ParallelismConfig).enabled
    inferred = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 8,
                                      "parallelism_config": {"dp_replicate_size": 2, "dp_shard_size": -1, "ep_size": 4}})
    assert resolve(host, config_file=inferred)["parallelism_config.ep_size"] == 4
    uneven = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4,
                                    "parallelism_config": {"dp_shard_size": 4, "ep_size": 3}})
    text = problems(host, config_file=uneven)
    assert "parallelism_config.ep_size" in text and "run.yaml:" in text
    assert "ep_size=3 does not divide parallelism_config.dp_shard_size (4)" in text
    alone = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4, "parallelism_config": {"ep_size": 2}})
    assert "ep_size=2 does not divide parallelism_config.dp_shard_size (1)" in problems(host, config_file=alone)
    ddp = config_file(tmp_path, {"strategy": "ddp", "num_processes": 4,
                                 "parallelism_config": {"dp_replicate_size": 4, "ep_size": 2}})
    assert "the strategy 'ddp' does not build an ep axis" in problems(host, config_file=ddp)
    with_tp = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4,
                                     "parallelism_config": {"dp_shard_size": 2, "tp_size": 2, "ep_size": 2}})
    text = problems(host, config_file=with_tp)
    assert "parallelism_config.ep_size" in text and "tp_size=2" in text and "not built" in text
    bad = config_file(tmp_path, {"strategy": "fsdp", "num_processes": 4,
                                 "parallelism_config": {"dp_shard_size": 4, "ep_size": -1}})
    assert "parallelism_config.ep_size" in problems(host, config_file=bad)


def test_the_launcher_offers_an_ep_size_flag(host):
    from torchrig.launch.cli import build_parser

    parser, _ = build_parser(host)
    assert "--ep_size" in parser.format_help()
