"""The configuration half of the ddp, fsdp and deepspeed strategy plugins, through the real resolver.

Their manifests are installed (entry points) without runtimes, so these tests see what a user
sees: Accelerate files resolving to typed, canonical values with file:line sources, every problem
reported at once, and validation that runs only for the selected strategy. DeepSpeed is imported
at most once (its import costs seconds); torch-freedom is checked in a subprocess.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings

import pytest
from torchrig.config.flags import add_config_flags, collect_flags, flag_values
from torchrig.config.resolve import Layer, Schema, resolve_config
from torchrig.errors import ConfigError
from torchrig.testing import make_host
from torchrig_ddp.options import DistributedDataParallelKwargs
from torchrig_deepspeed import config_checks
from torchrig_deepspeed.options import DeepSpeedPlugin
from torchrig_fsdp.options import FullyShardedDataParallelPlugin

SEED_FSDP = (pathlib.Path(__file__).parents[2] / "plugins" / "fsdp" / "tests" / "data" / "accelerate_fsdp_config.yaml").read_text()

MULTI_GPU = (pathlib.Path(__file__).parents[1] / "compat" / "data" / "accelerate_multi_gpu_config.yaml").read_text()

#: A Hugging Face style DeepSpeed config: "auto" everywhere the runtime fills values in.
HF_DS_CONFIG = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto",
                          "offload_optimizer": {"device": "cpu", "pin_memory": True}},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
}


@pytest.fixture(scope="module")
def host():
    return make_host()


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text) if isinstance(text, str) else json.dumps(text, indent=2))
    return str(path)


def resolve(host, path=None, **kwargs):
    kwargs.setdefault("environ", {})
    kwargs.setdefault("flags", {})
    kwargs.setdefault("default_file", False)
    kwargs.setdefault("warn", False)
    return resolve_config(host, config_file=path, **kwargs)


def problems_of(host, path=None, **kwargs):
    with pytest.raises(ConfigError) as info:
        resolve(host, path, **kwargs)
    return info.value.problems


def one(problems, *needles):
    """The single problem containing every needle (with the full list on failure)."""
    found = [p for p in problems if all(n in p for n in needles)]
    assert len(found) == 1, f"{needles} in:\n" + "\n".join(problems)
    return found[0]


def run_cli(*args, cwd=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    return subprocess.run([sys.executable, "-m", "torchrig", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


# -- fsdp ---------------------------------------------------------------------------------------


def test_seed_fsdp_file_resolves_to_canonical_values_with_sources(host, tmp_path):
    path = write(tmp_path, "seed_fsdp.yaml", SEED_FSDP)
    config = resolve(host, path)
    assert config["strategy"] == "fsdp" and config["mixed_precision"] == "bf16" and config["num_processes"] == 8
    expected = {
        "sharding_strategy": ("FULL_SHARD", 9),
        "auto_wrap_policy": ("TRANSFORMER_BASED_WRAP", 5),  # Accelerate's TRANSFORMER_LAYER spelling
        "backward_prefetch": ("BACKWARD_PRE", 6),
        "forward_prefetch": (False, 7),
        "cpu_offload": (False, 8),  # fsdp_offload_params
        "state_dict_type": ("FULL_STATE_DICT", 10),
        "sync_module_states": (True, 11),
        "use_orig_params": (True, 12),
    }
    for name, (value, line) in expected.items():
        key = f"fsdp_config.{name}"
        assert config[key] == value, key
        assert config.source(key).layer is Layer.CONFIG_FILE
        assert config.source(key).detail == f"{path}:{line}:3"
    assert not config.is_set("fsdp_config.min_num_params")
    assert config["fsdp_config.fsdp_version"] == 2
    section = config.section("fsdp_config")
    assert isinstance(section, FullyShardedDataParallelPlugin)
    assert section.resolved_reshard_after_forward is True
    assert {n.key for n in config.notes} == {"compute_environment", "downcast_bf16", "same_network"}


def test_accelerate_spellings_codes_and_torch_objects_normalise(host, tmp_path):
    path = write(tmp_path, "codes.yaml", """\
        distributed_type: fsdp
        fsdp_config:
          fsdp_sharding_strategy: 5
          fsdp_backward_prefetch_policy: 2
          fsdp_auto_wrap_policy: size_based
          fsdp_min_num_params: 1e6
          fsdp_state_dict_type: sharded_state_dict
          fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer, MistralDecoderLayer
          fsdp_reshard_after_forward: FULL_SHARD
          fsdp_cpu_ram_efficient_loading: 'true'
        """)
    config = resolve(host, path)
    assert config["fsdp_config.sharding_strategy"] == "_HYBRID_SHARD_ZERO2"
    assert config["fsdp_config.backward_prefetch"] == "BACKWARD_POST"
    assert config["fsdp_config.auto_wrap_policy"] == "SIZE_BASED_WRAP"
    assert config["fsdp_config.min_num_params"] == 1_000_000
    assert config["fsdp_config.state_dict_type"] == "SHARDED_STATE_DICT"
    assert config["fsdp_config.transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer", "MistralDecoderLayer"]
    assert config["fsdp_config.reshard_after_forward"] is True
    assert config["fsdp_config.cpu_ram_efficient_loading"] is True

    import torch
    from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, StateDictType

    plugin = FullyShardedDataParallelPlugin(
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        state_dict_type=StateDictType.FULL_STATE_DICT, cpu_offload=CPUOffload(offload_params=False),
        mixed_precision_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        transformer_layer_cls_to_wrap=[torch.nn.TransformerEncoderLayer], ignored_modules=[torch.nn.Linear(1, 1)])
    assert plugin.sharding_strategy == "SHARD_GRAD_OP" and plugin.cpu_offload is False
    assert plugin.transformer_layer_cls_to_wrap == ["TransformerEncoderLayer"]
    assert plugin.mixed_precision_policy["param_dtype"] is torch.bfloat16
    assert "keep_low_precision_grads" not in plugin.mixed_precision_policy  # FSDP1-only knob dropped
    config = resolve(host, arguments={"strategy": "fsdp", "fsdp_config": plugin})
    assert config.section("fsdp_config") == plugin
    assert config.source("fsdp_config.sharding_strategy").layer is Layer.ARGUMENT


def test_typo_inside_fsdp_config_names_the_key_with_did_you_mean(host, tmp_path):
    path = write(tmp_path, "typo.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_shardng_strategy: FULL_SHARD\n")
    problem = one(problems_of(host, path), "fsdp_config.fsdp_shardng_strategy")
    assert "did you mean 'fsdp_sharding_strategy'" in problem and f"{path}:3:3" in problem


@pytest.mark.parametrize(("line", "needles"), [
    ("fsdp_sharding_strategy: FULL_SHRD",
     ("fsdp_config.sharding_strategy", "must be one of", "did you mean 'FULL_SHARD'")),
    ("fsdp_sharding_strategy: 9", ("fsdp_config.sharding_strategy", "must be one of")),
    ("fsdp_auto_wrap_policy: TRANSFORMER", ("fsdp_config.auto_wrap_policy", "did you mean 'TRANSFORMER_BASED_WRAP'")),
    ("fsdp_state_dict_type: LOCAL_STATE_DICT", ("fsdp_config.state_dict_type", "FSDP1-only", "SHARDED_STATE_DICT")),
    ("fsdp_version: 1", ("fsdp_config.fsdp_version", "FSDP2")),
    ("fsdp_offload_params: maybe", ("fsdp_config.cpu_offload", "expected true or false")),
    ("fsdp_min_num_params: -1", ("fsdp_config.min_num_params", "at least 0")),
    ("fsdp_mixed_precision_policy: {param_dtype: bf61}", ("fsdp_config.mixed_precision_policy", "did you mean 'bf16'")),
    ("fsdp_state_dict_config: {offload_to_cpu: true, rank_0_only: true}", ("did you mean 'rank0_only'",)),
])
def test_bad_fsdp_values_are_reported_with_reason_and_location(host, tmp_path, line, needles):
    path = write(tmp_path, "bad.yaml", f"distributed_type: FSDP\nfsdp_config:\n  {line}\n")
    problem = one(problems_of(host, path), *needles)
    assert f"{path}:3:3" in problem


def test_fsdp_validation_reports_every_problem_and_only_for_fsdp(host, tmp_path):
    body = """\
        fsdp_config:
          fsdp_offload_params: true
          fsdp_sharding_strategy: HYBRID_SHARD
          fsdp_cpu_ram_efficient_loading: true
          fsdp_sync_module_states: false
          fsdp_activation_checkpointing: true
          fsdp_auto_wrap_policy: NO_WRAP
        use_cpu: true
        num_machines: 2
        num_processes: 5
        main_process_ip: 10.0.0.1
        """
    problems = problems_of(host, write(tmp_path, "fsdp.yaml", "distributed_type: FSDP\n" + textwrap.dedent(body)))
    one(problems, "fsdp_config.cpu_offload", "uses the CPU")
    one(problems, "fsdp_config.sharding_strategy", "multiple of num_machines")
    one(problems, "fsdp_config.cpu_ram_efficient_loading", "sync_module_states")
    one(problems, "fsdp_config.activation_checkpointing", "NO_WRAP")
    assert len(problems) == 4
    # The same section under another strategy is parsed but not validated: it is not used.
    config = resolve(host, write(tmp_path, "ddp.yaml", "distributed_type: MULTI_CPU\n" + textwrap.dedent(body)))
    assert config["strategy"] == "ddp" and config["fsdp_config.cpu_offload"] is True


def test_hybrid_shard_on_one_machine_is_allowed(host, tmp_path):
    config = resolve(host, write(tmp_path, "h.yaml", "distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n"
                                                     "  fsdp_sharding_strategy: HYBRID_SHARD\n"))
    assert config["fsdp_config.sharding_strategy"] == "HYBRID_SHARD"


# -- ddp ----------------------------------------------------------------------------------------


def test_accelerate_multi_gpu_file_resolves_to_ddp(host, tmp_path):
    config = resolve(host, write(tmp_path, "multi_gpu.yaml", MULTI_GPU))
    assert config["strategy"] == "ddp"
    assert config.section("ddp_config") == DistributedDataParallelKwargs()
    # No strategy named, several processes: ddp is the installed default for distributed runs.
    config = resolve(host, write(tmp_path, "four.yaml", "num_processes: 4\n"))
    assert config["strategy"] == "ddp" and "default for 4 processes" in str(config.source("strategy"))


def test_ddp_options_from_file_flags_and_accelerate_enum(host, tmp_path):
    class DDPCommunicationHookType(str, enum.Enum):  # Accelerate's enum, which is not installed here
        NO = "no"
        FP16 = "fp16"
        POWER_SGD = "power_sgd"

    kwargs = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.POWER_SGD, comm_wrapper="FP16",
                                           comm_state_option={"matrix_approximation_rank": 2})
    assert kwargs.comm_hook == "power_sgd" and kwargs.comm_wrapper == "fp16"
    path = write(tmp_path, "ddp.yaml", "distributed_type: MULTI_GPU\nddp_config:\n  bucket_cap_mb: 50\n")
    config = resolve(host, path, arguments={"ddp_config": kwargs},
                     flags={"ddp_config.static_graph": ("true", "--ddp_static_graph")})
    assert config["ddp_config.bucket_cap_mb"] == 50 and config["ddp_config.comm_hook"] == "power_sgd"
    assert config["ddp_config.static_graph"] is True
    assert str(config.source("ddp_config.static_graph")) == "flag --ddp_static_graph"


def test_ddp_comm_hook_combinations_torch_cannot_run(host, tmp_path):
    def problems(ddp_config):
        lines = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in ddp_config.items())
        return problems_of(host, write(tmp_path, "d.yaml", f"distributed_type: MULTI_GPU\nddp_config:\n{lines}"))

    one(problems({"comm_wrapper": "fp16"}), "ddp_config.comm_wrapper", "needs a PowerSGD hook")
    one(problems({"comm_hook": "fp16", "comm_wrapper": "bf16"}), "ddp_config.comm_wrapper", "already compresses")
    one(problems({"comm_hook": "bf16", "comm_state_option": {"matrix_approximation_rank": 2}}),
        "ddp_config.comm_state_option", "only with comm_hook power_sgd")
    one(problems({"comm_hook": "power_sgd", "comm_state_option": {"matrix_aproximation_rank": 2}}),
        "unknown PowerSGDState argument", "did you mean 'matrix_approximation_rank'")
    one(problems({"comm_hook": "powersgd"}), "ddp_config.comm_hook", "did you mean 'power_sgd'")


# -- deepspeed ----------------------------------------------------------------------------------


def ds_run(tmp_path, ds_config, extra="", name="ds.json"):
    ds_path = write(tmp_path, name, ds_config)
    return write(tmp_path, "run.yaml", f"distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       f"  deepspeed_config_file: {ds_path}\n" + textwrap.dedent(extra)), ds_path


def test_hf_style_deepspeed_config_with_auto_values_is_valid(host, tmp_path):
    path, ds_path = ds_run(tmp_path, HF_DS_CONFIG, "mixed_precision: bf16\nnum_processes: 4\n"
                                                   "gradient_accumulation_steps: 4\n")
    config = resolve(host, path)
    assert config["strategy"] == "deepspeed" and config["deepspeed_config.hf_ds_config"] == ds_path
    assert isinstance(config.section("deepspeed_config"), DeepSpeedPlugin)


def test_unknown_top_level_deepspeed_key_gets_did_you_mean_and_line(host, tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {"stage": 3}, "bf16": {"enabled": True}}
    path, ds_path = ds_run(tmp_path, ds)
    problem = one(problems_of(host, path), "'zero_optimisation'")
    assert "did you mean 'zero_optimization'" in problem and f"{ds_path}:3:3" in problem
    keys, why = config_checks.deepspeed_top_level_keys()
    assert why == "" and {"zero_optimization", "bf16", "fp16", "optimizer", "gradient_clipping"} <= keys


def test_keys_below_the_top_level_are_checked_by_deepspeeds_own_models(host, tmp_path):
    ds = {"zero_optimization": {"stage": 3, "offload_params": {"device": "cpu"}}, "bf16": {"enabled": True},
          "fp16": {"enabled": False, "loss_scal": 0}}
    path, ds_path = ds_run(tmp_path, ds)
    problems = problems_of(host, path)
    one(problems, "'zero_optimization.offload_params'", "did you mean 'offload_param'", ds_path)
    one(problems, "'fp16.loss_scal'", "did you mean 'loss_scale'", ds_path)  # the next block, same run


@pytest.mark.parametrize(("precision", "block", "other"), [("fp16", "bf16", "bf16"), ("bf16", "fp16", "fp16")])
def test_mixed_precision_contradicting_the_deepspeed_json(host, tmp_path, precision, block, other):
    path, ds_path = ds_run(tmp_path, {"train_micro_batch_size_per_gpu": 1, block: {"enabled": True}},
                           f"mixed_precision: {precision}\n")
    problem = one(problems_of(host, path), "mixed_precision", f"enables {other}")
    assert f"{path}:4:1" in problem and ds_path in problem


def test_fp16_on_cpu_is_refused(host, tmp_path):
    path, _ = ds_run(tmp_path, {"fp16": {"enabled": "auto"}}, "mixed_precision: fp16\nuse_cpu: true\n")
    one(problems_of(host, path), "mixed_precision", "needs a CUDA GPU")


def test_batch_arithmetic_accumulation_stage_and_offload_reported_together(host, tmp_path):
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    path, ds_path = ds_run(tmp_path, ds, """\
          zero_stage: 2
          offload_optimizer_device: nvme
        gradient_accumulation_steps: 2
        num_processes: 8
        """)
    problems = problems_of(host, path)
    one(problems, "train_batch_size = 32", "2 × 4 × 8", "= 64", f"{ds_path}:2:3")
    one(problems, "gradient_accumulation_steps (", "disagrees", "= 4")
    one(problems, "deepspeed_config.zero_stage", "'zero_optimization.stage'", "= 3")
    one(problems, "deepspeed_config.offload_optimizer_device", "offload_optimizer_nvme_path")
    assert len(problems) == 4


def test_train_batch_size_consistent_with_num_processes_is_valid(host, tmp_path):
    ds = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
          "zero_optimization": {"stage": "auto"}}
    path, _ = ds_run(tmp_path, ds, "gradient_accumulation_steps: 4\nnum_processes: 8\n")
    assert resolve(host, path)["gradient_accumulation_steps"] == 4


def test_deepspeed_json_from_python_and_duplicate_keys(host, tmp_path):
    problems = problems_of(host, arguments={"strategy": "deepspeed", "num_processes": 2, "deepspeed_config":
                                            DeepSpeedPlugin(hf_ds_config={"zero_optimizaton": {}})})
    one(problems, "Accelerator(deepspeed_config=...)", "did you mean 'zero_optimization'")
    ds_path = write(tmp_path, "dup.json", '{\n  "bf16": {"enabled": true},\n  "bf16": {"enabled": false}\n}\n')
    problem = one(problems_of(host, arguments={"strategy": "deepspeed", "deepspeed_config": {"hf_ds_config": ds_path}}),
                  "duplicate key 'bf16'")
    assert f"{ds_path}:3:3" in problem
    commented = write(tmp_path, "hjson.json", '{\n  // DeepSpeed reads hjson\n  "bf16": {"enabled": true}\n}\n')
    resolve(host, arguments={"strategy": "deepspeed", "deepspeed_config": {"hf_ds_config": commented}})
    one(problems_of(host, arguments={"strategy": "deepspeed", "deepspeed_config": {"hf_ds_config": "nope.json"}}),
        "no such DeepSpeed config file")


def test_unsupported_launchers_are_refused_with_reason(host, tmp_path):
    path = write(tmp_path, "l.yaml", """\
        distributed_type: DEEPSPEED
        deepspeed_config:
          deepspeed_multinode_launcher: pdsh
          deepspeed_hostfile: /job/hostfile
        """)
    problems = problems_of(host, path)
    one(problems, "deepspeed_config.deepspeed_multinode_launcher", "'pdsh' is not supported", "torchrig launch")
    one(problems, "deepspeed_config.deepspeed_hostfile", "torchrig launch")
    config = resolve(host, write(tmp_path, "s.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                                     "  deepspeed_multinode_launcher: standard\n"
                                                     "  deepspeed_moe_layer_cls_names: MixtralSparseMoeBlock,Other\n"))
    assert config["deepspeed_config.deepspeed_moe_layer_cls_names"] == ["MixtralSparseMoeBlock", "Other"]


def test_unchecked_keys_warn_when_deepspeed_is_not_importable(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.config", None)  # import of it raises ImportError
    keys, why = config_checks.deepspeed_top_level_keys.__wrapped__()
    assert keys is None and "deepspeed is not importable" in why
    monkeypatch.setattr(config_checks, "deepspeed_top_level_keys", lambda: (None, why))
    with pytest.warns(config_checks.DeepSpeedConfigNotChecked, match="not importable"):
        assert config_checks._unknown_keys(config_checks.DeepSpeedJSON({"zero_optimisation": {}})) == []


# -- flags, CLI and import hygiene --------------------------------------------------------------


def test_plugin_flags_set_section_keys_and_two_strategy_switches_conflict(host, tmp_path):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    by_dest = add_config_flags(parser, collect_flags(Schema(host)))
    with pytest.raises(ConfigError, match="--use_fsdp and --use_deepspeed both set strategy"):
        flag_values(parser.parse_args(["--use_fsdp", "--use_deepspeed"]), by_dest)
    flags = flag_values(parser.parse_args(["--use_fsdp", "--fsdp_sharding_strategy", "2", "--fsdp_offload_params",
                                           "false", "--fsdp_transformer_layer_cls_to_wrap", "A,B"]), by_dest)
    config = resolve(host, write(tmp_path, "seed.yaml", SEED_FSDP), flags=flags)
    assert config["fsdp_config.sharding_strategy"] == "SHARD_GRAD_OP"
    assert str(config.source("fsdp_config.sharding_strategy")) == "flag --fsdp_sharding_strategy"
    assert config["fsdp_config.transformer_layer_cls_to_wrap"] == ["A", "B"]
    flags = flag_values(parser.parse_args(["--use_deepspeed", "--zero_stage", "3", "--gradient_clipping", "1.0"]),
                        by_dest)
    config = resolve(host, flags=flags)
    assert (config["strategy"], config["deepspeed_config.zero_stage"]) == ("deepspeed", 3)
    assert config["deepspeed_config.gradient_clipping"] == 1.0


@pytest.mark.multiprocess
def test_plugins_json_lists_the_first_party_strategies_as_available():
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(result.stdout)["plugins"]}
    for name, dist in (("ddp", "torchrig-ddp"), ("fsdp", "torchrig-fsdp"), ("deepspeed", "torchrig-deepspeed")):
        row = rows[("strategy", name)]
        assert row["status"] == "available" and row["distribution"] == dist and row["summary"], row


@pytest.mark.multiprocess
def test_manifests_options_and_schema_do_not_import_torch_or_deepspeed():
    code = textwrap.dedent("""\
        import sys
        import torchrig_ddp.manifest, torchrig_fsdp.manifest, torchrig_deepspeed.manifest
        import torchrig_deepspeed.config_checks
        import torchrig
        from torchrig.config.resolve import Schema
        from torchrig.testing import make_host
        schema = Schema(make_host())
        assert {"ddp_config", "fsdp_config", "deepspeed_config"} <= set(schema.sections), schema.sections
        assert torchrig.FullyShardedDataParallelPlugin.__module__ == "torchrig_fsdp.options"
        assert torchrig.DeepSpeedPlugin.__module__ == "torchrig_deepspeed.options"
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "deepspeed"))
        assert not heavy, heavy
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.multiprocess
def test_config_validate_seed_fsdp_on_cpu(tmp_path):
    path = write(tmp_path, "seed_fsdp.yaml", SEED_FSDP)
    result = run_cli("config", "validate", path, "--num_processes", "2", "--use_cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{path}: valid (strategy fsdp, mixed_precision bf16" in result.stdout
    # Offload is what FSDP2 cannot do on the CPU: the same file with it on is refused, exit 2.
    text = SEED_FSDP.replace("fsdp_offload_params: false", "fsdp_offload_params: true")
    offload = write(tmp_path, "offload.yaml", text)
    result = run_cli("config", "validate", offload, "--num_processes", "2", "--use_cpu")
    assert result.returncode == 2
    assert "fsdp_config.cpu_offload" in result.stderr and f"{offload}:8:3" in result.stderr


def test_options_classes_are_usable_directly():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DeepSpeedPlugin(hf_ds_config="none").hf_ds_config is None
        assert DeepSpeedPlugin(offload_param_device="CPU").offload_param_device == "cpu"
    with pytest.raises(ValueError, match="FSDP1-only"):
        FullyShardedDataParallelPlugin(state_dict_type="LOCAL_STATE_DICT")
    with pytest.raises(ValueError, match="must be one of"):
        DistributedDataParallelKwargs(comm_hook="int8")


# -- sections declared by reference: built on first read --------------------------------------


def test_a_plugin_section_no_source_sets_is_built_on_first_read_like_every_other(host):
    """The fsdp, deepspeed, fp8 and ddp sections declare their options classes by reference; a run
    that sets none of their keys builds them only when read, with the same values, sources and
    order an eager resolution has (defaults, the schema's key order)."""
    schema = Schema(host)
    deferred = [key for key in schema.sections if schema.is_deferred(key)]
    assert {"fsdp_config", "deepspeed_config", "fp8_config", "ddp_config"} <= set(deferred)
    config = resolve(host)
    assert config["fsdp_config.sharding_strategy"] == "FULL_SHARD"
    assert config.source("fsdp_config.sharding_strategy").layer is Layer.DEFAULT
    assert not config.is_set("ddp_config.bucket_cap_mb")
    assert config.section_of(DeepSpeedPlugin).zero_stage == DeepSpeedPlugin().zero_stage
    assert list(config) == schema.all_keys()
    for key in deferred:
        assert config.section(key) == schema.options(key)(), key
        assert all(config.source(k).layer is Layer.DEFAULT for k in config if k.startswith(f"{key}."))
    # A key set by any source builds its section with the others, checked as before.
    config = resolve(host, environ={"TORCHRIG_FSDP_CONFIG__MIN_NUM_PARAMS": "5"})
    assert config["fsdp_config.min_num_params"] == 5
    assert config.source("fsdp_config.min_num_params").layer is Layer.ENV
    assert "TORCHRIG_FSDP_CONFIG__MIN_NUM_PRAMS" in one(
        problems_of(host, environ={"TORCHRIG_FSDP_CONFIG__MIN_NUM_PRAMS": "5"}), "unknown torchrig environment variable",
        "TORCHRIG_FSDP_CONFIG__MIN_NUM_PARAMS")


def test_a_section_whose_options_reference_is_wrong_fails_when_used_naming_the_section(fake_modules):
    from torchrig.errors import PluginError
    from torchrig.plugin.hookspecs import HOOK_API_VERSION
    from torchrig.plugin.manifest import PluginManifest
    from torchrig.plugin.types import ConfigSection
    from torchrig.testing import plugin_distribution

    class BrokenManifest(PluginManifest):
        api_version = HOOK_API_VERSION
        config_section = ConfigSection("zz_config", "tr_fake_no_such_module:Options")

    fake_modules.add("tr_fake_broken_section", BrokenManifest=BrokenManifest)
    broken = make_host(plugin_distribution("tr-fake", "1.0", [("strategy", "zz", None, "tr_fake_broken_section:BrokenManifest")]))
    config = resolve(broken)  # nobody set a zz_config key: nothing imported yet
    with pytest.raises(PluginError, match=r"section 'zz_config': its options class 'tr_fake_no_such_module:Options' "
                                          r"failed to import: ModuleNotFoundError"):
        config["zz_config.level"]
    with pytest.raises(PluginError, match="'zz_config'"):
        resolve(broken, environ={"TORCHRIG_ZZ_CONFIG__LEVEL": "1"})
