"""One typed configuration from five sources: precedence, provenance, validation, Accelerate files."""

from __future__ import annotations

import textwrap
import warnings

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrig import DataLoaderConfiguration, GradScalerKwargs, InitProcessGroupKwargs, ProjectConfiguration
from torchrig.config.compat import ACCELERATE_KEYS
from torchrig.config.readers import encode_launch_overrides, env_name
from torchrig.config.resolve import ConfigOverrideWarning, Layer, resolve_config
from torchrig.errors import ConfigError
from torchrig.testing import make_host


@pytest.fixture(scope="module")
def host():
    return make_host()


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def resolve(host, **kwargs):
    kwargs.setdefault("environ", {})
    kwargs.setdefault("flags", {})
    kwargs.setdefault("default_file", False)
    kwargs.setdefault("warn", False)
    return resolve_config(host, **kwargs)


# -- precedence --------------------------------------------------------------------------------


def test_defaults_when_nothing_is_given(host):
    config = resolve(host)
    assert config["mixed_precision"] == "no"
    assert config["strategy"] == "single"
    assert config["gradient_accumulation_steps"] == 1
    assert config.source("mixed_precision").layer is Layer.DEFAULT
    assert config["dynamo_config.backend"] == "no"  # nothing compiles unless configured
    assert config.section("dataloader_config") == DataLoaderConfiguration()


def test_script_argument_beats_machine_default_file(host, tmp_path):
    default = write(tmp_path, "default_config.yaml", "mixed_precision: 'no'\ngradient_accumulation_steps: 2\n")
    config = resolve(host, default_file=default, arguments={"mixed_precision": "bf16"})
    assert config["mixed_precision"] == "bf16"  # never silently fp32 (diffusers#1272, accelerate#300)
    assert config.source("mixed_precision").layer is Layer.ARGUMENT
    assert config["gradient_accumulation_steps"] == 2  # a key the script did not pass
    assert str(config.source("gradient_accumulation_steps")).endswith("default_config.yaml:2:1")


def test_run_file_beats_argument_with_a_warning_naming_both(host, tmp_path):
    run = write(tmp_path, "run.yaml", "mixed_precision: fp16\n")
    with pytest.warns(ConfigOverrideWarning) as record:
        config = resolve(host, config_file=run, arguments={"mixed_precision": "bf16"}, warn=True)
    assert config["mixed_precision"] == "fp16"
    message = str(record[0].message)
    assert "Accelerator(mixed_precision=...)" in message and "'bf16'" in message
    assert "run.yaml:1:1" in message and "'fp16'" in message


def test_environment_beats_file_and_flag_beats_environment(host, tmp_path):
    run = write(tmp_path, "run.yaml", "mixed_precision: fp16\ngradient_accumulation_steps: 3\n")
    environ = {"TORCHRIG_MIXED_PRECISION": "bf16", "TORCHRIG_GRADIENT_ACCUMULATION_STEPS": "5"}
    config = resolve(host, config_file=run, environ=environ, flags={"gradient_accumulation_steps": ("7", "--gradient_accumulation_steps")})
    assert config["mixed_precision"] == "bf16"
    assert str(config.source("mixed_precision")) == "environment TORCHRIG_MIXED_PRECISION"
    assert config["gradient_accumulation_steps"] == 7
    assert str(config.source("gradient_accumulation_steps")) == "flag --gradient_accumulation_steps"


def test_flags_reach_workers_through_the_launch_overrides_variable(host):
    environ = {"TORCHRIG_LAUNCH_OVERRIDES": encode_launch_overrides({"mixed_precision": ("fp16", "--mixed_precision")})}
    config = resolve(host, environ=environ, flags=None, arguments={"mixed_precision": "bf16"})
    assert config["mixed_precision"] == "fp16"
    assert config.source("mixed_precision").layer is Layer.FLAG


def test_config_file_named_by_environment_variable(host, tmp_path):
    run = write(tmp_path, "run.yaml", "gradient_accumulation_steps: 6\n")
    config = resolve(host, environ={"TORCHRIG_CONFIG_FILE": run})
    assert config["gradient_accumulation_steps"] == 6


def test_strict_config_turns_overrides_into_errors(host, tmp_path):
    run = write(tmp_path, "run.yaml", "mixed_precision: fp16\n")
    with pytest.raises(ConfigError, match="strict_config is on"):
        resolve(host, config_file=run, arguments={"mixed_precision": "bf16", "strict_config": True})
    # Same value: nothing was overridden.
    resolve(host, config_file=run, arguments={"mixed_precision": "fp16", "strict_config": True})


def test_a_flag_equal_to_the_scripts_argument_once_coerced_is_no_override(host):
    """Accelerate's examples pass ``Accelerator(cpu=args.cpu)`` and are launched with ``--cpu``: the flag's text
    ``'true'`` equals the script's ``True`` as a bool, so nothing is reported (and strict_config accepts it)."""
    flags = {"use_cpu": ("true", "--cpu"), "gradient_accumulation_steps": ("2", "--gradient_accumulation_steps")}
    arguments = {"use_cpu": True, "gradient_accumulation_steps": 2, "strict_config": True}
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigOverrideWarning)
        config = resolve(host, flags=flags, arguments=arguments, warn=True)
    assert config["use_cpu"] is True and config["gradient_accumulation_steps"] == 2
    with pytest.warns(ConfigOverrideWarning, match="use_cpu=...\\) = False is overridden by flag --cpu = 'true'"):
        resolve(host, flags=flags, arguments={"use_cpu": False}, warn=True)

def test_options_objects_set_all_their_fields(host, tmp_path):
    default = write(tmp_path, "d.yaml", "dataloader_config: {even_batches: false, non_blocking: true}\n")
    config = resolve(host, default_file=default, arguments={
        "dataloader_config": DataLoaderConfiguration(split_batches=True),
        "project_config": ProjectConfiguration(project_dir="out", total_limit=2),
        "grad_scaler_kwargs": GradScalerKwargs(init_scale=1024.0),
        "init_process_group_kwargs": InitProcessGroupKwargs(timeout=60),
    })
    assert config.section("dataloader_config") == DataLoaderConfiguration(split_batches=True)
    assert config["project_config.total_limit"] == 2
    assert config["grad_scaler_kwargs.init_scale"] == 1024.0
    assert config["init_process_group_kwargs.timeout"] == 60.0


def test_extends_layers_files_with_provenance(host, tmp_path):
    write(tmp_path, "base.yaml", "mixed_precision: bf16\ngradient_accumulation_steps: 2\n")
    run = write(tmp_path, "run.yaml", "extends: base.yaml\ngradient_accumulation_steps: 4\n")
    config = resolve(host, config_file=run)
    assert (config["mixed_precision"], config["gradient_accumulation_steps"]) == ("bf16", 4)
    assert str(config.source("mixed_precision")).endswith("base.yaml:1:1")
    assert str(config.source("gradient_accumulation_steps")).endswith("run.yaml:2:1")


# -- reading values ----------------------------------------------------------------------------


def test_yaml_1_1_booleans_in_enum_and_bool_fields(host, tmp_path):
    run = write(tmp_path, "run.yaml", "mixed_precision: no\nuse_cpu: yes\n")
    config = resolve(host, config_file=run)
    assert config["mixed_precision"] == "no"
    assert config["use_cpu"] is True


def test_accelerate_multi_cpu_default_file_loads(host, tmp_path):
    # What `accelerate config` writes for one CPU process (distributed_type NO).
    run = write(tmp_path, "default_config.yaml", """\
        compute_environment: LOCAL_MACHINE
        debug: false
        distributed_type: 'NO'
        downcast_bf16: 'no'
        enable_cpu_affinity: false
        machine_rank: 0
        main_training_function: main
        mixed_precision: 'no'
        num_machines: 1
        num_processes: 1
        rdzv_backend: static
        same_network: true
        tpu_env: []
        tpu_use_cluster: false
        tpu_use_sudo: false
        use_cpu: true
        dynamo_config:
          dynamo_backend: 'NO'
    """)
    config = resolve(host, config_file=run)
    assert config["strategy"] == "single"
    assert config["rdzv_backend"] == "static"
    assert config["dynamo_config.backend"] == "no"
    assert {n.key for n in config.notes} >= {"compute_environment", "downcast_bf16", "same_network", "debug",
                                             "enable_cpu_affinity", "main_training_function", "tpu_env"}


# -- errors --------------------------------------------------------------------------------------


def problems_of(host, **kwargs):
    with pytest.raises(ConfigError) as excinfo:
        resolve(host, **kwargs)
    return excinfo.value.problems


def test_every_problem_in_one_error_with_key_and_line(host, tmp_path):
    run = write(tmp_path, "bad.yaml", """\
        mixed_precison: bf16
        num_processes: zero
        gradient_accumulation_steps: -1
        machine_rank: 3
        mixed_precision: fp32
        dataloader_config:
          split_batchez: true
    """)
    problems = problems_of(host, config_file=run)
    text = "\n".join(problems)
    assert "mixed_precison (" in text and "bad.yaml:1:1" in text and "did you mean 'mixed_precision'" in text
    assert "num_processes" in text and "bad.yaml:2:1" in text and "expected an integer" in text
    assert "gradient_accumulation_steps" in text and "at least 1" in text
    assert "machine_rank" in text and "below num_machines" in text
    assert "no precision plugin named 'fp32'" in text
    assert "dataloader_config.split_batchez" in text and "did you mean 'split_batches'" in text
    assert len(problems) == 6


def test_malformed_yaml_names_line_and_column(host, tmp_path):
    run = write(tmp_path, "broken.yaml", "mixed_precision: bf16\nnum_processes: [1, 2\n")
    text = "\n".join(problems_of(host, config_file=run))
    assert "broken.yaml:" in text


def test_duplicate_keys_are_rejected(host, tmp_path):
    run = write(tmp_path, "dup.yaml", "mixed_precision: bf16\nmixed_precision: fp16\n")
    text = "\n".join(problems_of(host, config_file=run))
    assert "duplicate key 'mixed_precision'" in text


def test_unknown_environment_variable_is_an_error(host):
    text = "\n".join(problems_of(host, environ={"TORCHRIG_MIXED_PRECISON": "bf16"}))
    assert "TORCHRIG_MIXED_PRECISON" in text and "did you mean 'TORCHRIG_MIXED_PRECISION'" in text


def test_wrong_type_from_environment(host):
    text = "\n".join(problems_of(host, environ={"TORCHRIG_USE_CPU": "maybe"}))
    assert "use_cpu" in text and "TORCHRIG_USE_CPU" in text and "expected true or false" in text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("compute_environment: AMAZON_SAGEMAKER\n", "SageMaker"),
        ("debug: true\n", "debug"),
        ("tpu_name: my-tpu\n", "TPUs are not supported"),
        ("ec2_instance_type: ml.p3.2xlarge\n", "SageMaker"),
        ("mixed_precision: fp8\nuse_cpu: true\nfp8_config: {backend: TE, emulate: true}\n", "fp8 runs on torchao"),
        ("distributed_type: XLA\n", "no strategy plugin named 'XLA'"),
        ("num_processes: 0\n", "at least 1"),
        ("num_machines: 2\n", "main_process_ip"),
        ("main_process_port: 70000\n", "between 0 and 65535"),
        ("rdzv_backend: zookeeper\n", "must be one of static, c10d, etcd, etcd-v2"),
        ("strategy: single\ndistributed_type: FSDP\n", "two strategies at once"),
        ("gradient_accumulation_steps: 4\ngradient_accumulation_plugin: {num_steps: 2}\n", "disagrees"),
        ("log_with: [wandbb]\n", "no tracker plugin named 'wandbb'"),
        ("project_config: 3\n", "must be a mapping of ProjectConfiguration options"),
    ],
)
def test_rejected_values_name_the_key_and_say_why(host, tmp_path, text, expected):
    run = write(tmp_path, "c.yaml", text)
    assert expected in "\n".join(problems_of(host, config_file=run))


def test_missing_config_file_is_a_clear_error(host, tmp_path):
    text = "\n".join(problems_of(host, config_file=str(tmp_path / "nope.yaml")))
    assert "nope.yaml" in text


def test_env_names_are_derived_from_keys():
    assert env_name("mixed_precision") == "TORCHRIG_MIXED_PRECISION"
    assert env_name("dataloader_config.split_batches") == "TORCHRIG_DATALOADER_CONFIG__SPLIT_BATCHES"


def test_section_field_from_environment(host):
    config = resolve(host, environ={"TORCHRIG_DATALOADER_CONFIG__SPLIT_BATCHES": "true"})
    assert config["dataloader_config.split_batches"] is True


def test_disable_plugins_comes_from_its_variable(host):
    config = resolve(host, environ={"TORCHRIG_DISABLE_PLUGINS": "precision:fp16,tracker:x"})
    assert config["disable_plugins"] == ["precision:fp16", "tracker:x"]


# -- property tests ----------------------------------------------------------------------------

valid_configs = st.fixed_dictionaries(
    {},
    optional={
        "mixed_precision": st.sampled_from(["no", "fp16", "bf16"]),
        "use_cpu": st.booleans(),
        "num_processes": st.integers(1, 64),
        "gradient_accumulation_steps": st.integers(1, 64),
        "rdzv_backend": st.sampled_from(["static", "c10d"]),
        "main_process_port": st.integers(0, 65535),
        "dataloader_config": st.fixed_dictionaries({}, optional={
            "split_batches": st.booleans(), "even_batches": st.booleans(), "data_seed": st.integers(0, 2**31),
        }),
        "project_config": st.fixed_dictionaries({}, optional={
            "project_dir": st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8),
            "total_limit": st.integers(1, 10),
        }),
        "grad_scaler_kwargs": st.fixed_dictionaries({}, optional={"init_scale": st.floats(1.0, 1e6)}),
    },
).filter(lambda d: d.get("num_processes", 1) == 1 or True)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=valid_configs)
def test_valid_configs_round_trip_through_yaml(host, tmp_path, data):
    if data.get("num_processes", 1) > 1:
        data = {**data, "strategy": "single", "num_processes": 1}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    first = resolve(host, config_file=str(path))
    path.write_text(yaml.safe_dump(first.to_nested(only_set=True)))
    second = resolve(host, config_file=str(path))
    assert first.values == second.values
    for key, value in data.items():
        if isinstance(value, dict):
            for sub, sub_value in value.items():
                assert first[f"{key}.{sub}"] == sub_value
        else:
            assert first[key] == value


yaml_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8))
yaml_values = st.recursive(yaml_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                  st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                           max_leaves=8)
known_keys = st.sampled_from(["mixed_precision", "num_processes", "use_cpu", "strategy", "distributed_type",
                              "dataloader_config", "fsdp_config", "deepspeed_config", "log_with", "debug", "tpu_env",
                              "project_config", "gpu_ids", "machine_rank", "dynamo_config", "extends"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=st.dictionaries(st.one_of(known_keys, st.text(max_size=10)), yaml_values, max_size=5))
def test_arbitrary_yaml_documents_raise_only_config_error(host, tmp_path, document):
    path = tmp_path / "any.yaml"
    path.write_text(yaml.safe_dump(document))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            resolve(host, config_file=str(path))
        except ConfigError:
            pass


# -- every Accelerate key ------------------------------------------------------------------------


SUPPORTED_EXAMPLES = {
    "distributed_type": ("NO", "strategy", "single"),
    "mixed_precision": ("bf16", "mixed_precision", "bf16"),
    "use_cpu": (True, "use_cpu", True),
    "num_processes": (1, "num_processes", 1),
    "num_machines": (1, "num_machines", 1),
    "machine_rank": (0, "machine_rank", 0),
    "main_process_ip": ("10.0.0.1", "main_process_ip", "10.0.0.1"),
    "main_process_port": (29500, "main_process_port", 29500),
    "rdzv_backend": ("static", "rdzv_backend", "static"),
    "gpu_ids": ("all", "gpu_ids", "all"),
    "dynamo_config": ({"dynamo_backend": "INDUCTOR"}, "dynamo_config.backend", "inductor"),
    "dynamo_backend": ("INDUCTOR", "dynamo_config.backend", "inductor"),
    "fsdp_config": ({"fsdp_sharding_strategy": "SHARD_GRAD_OP"}, "fsdp_config.sharding_strategy", "SHARD_GRAD_OP"),
    "deepspeed_config": ({"zero_stage": 2}, "deepspeed_config.zero_stage", 2),
    "fp8_config": ({"backend": "ao", "recipe": "ROWWISE"}, "fp8_config.recipe", "rowwise"),
    "parallelism_config": ({"parallelism_config_dp_shard_size": -1}, "parallelism_config.dp_shard_size", -1),
}
OFF_VALUES = {"compute_environment": "LOCAL_MACHINE", "downcast_bf16": "no", "same_network": True,
              "main_training_function": "main"}
ON_VALUES = {"compute_environment": "AMAZON_SAGEMAKER", "debug": True, "enable_cpu_affinity": True,
             "use_mps_device": True, "megatron_lm_config": {"megatron_lm_tp_degree": 2},
             "ipex_config": {"ipex": True},
             "mpirun_config": {"mpirun_ccl": 1}, "tpu_name": "tpu", "tpu_zone": "zone", "tpu_use_cluster": True,
             "tpu_use_sudo": True, "tpu_vm": ["vm"], "tpu_env": ["A=1"], "command_file": "cmds.sh", "commands": ["ls"]}


@pytest.mark.parametrize("entry", ACCELERATE_KEYS, ids=lambda e: e.key)
def test_every_accelerate_key_is_supported_accepted_or_rejected_never_dropped(host, tmp_path, entry):
    path = tmp_path / "accelerate.yaml"
    if entry.status == "supported":
        value, key, expected = SUPPORTED_EXAMPLES[entry.key]
        path.write_text(yaml.safe_dump({entry.key: value}))
        assert resolve(host, config_file=str(path))[key] == expected
    elif entry.status == "no_effect":
        path.write_text(yaml.safe_dump({entry.key: OFF_VALUES.get(entry.key, False)}))
        config = resolve(host, config_file=str(path))
        assert [n.key for n in config.notes] == [entry.key] and config.notes[0].reason == entry.note
        if entry.key in ON_VALUES:
            path.write_text(yaml.safe_dump({entry.key: ON_VALUES[entry.key]}))
            assert f"{entry.key} (" in "\n".join(problems_of(host, config_file=str(path)))
    else:
        path.write_text(yaml.safe_dump({entry.key: "something"}))
        text = "\n".join(problems_of(host, config_file=str(path)))
        assert entry.key in text and entry.note in text


def test_gpu_ids_with_use_cpu_are_refused_naming_both(host):
    """`--cpu --gpu_ids 0` was accepted silently: the GPUs listed are never used on the CPU."""
    flags = {"use_cpu": ("true", "--cpu"), "gpu_ids": ("0", "--gpu_ids")}
    with pytest.raises(ConfigError, match=r"gpu_ids \(flag --gpu_ids\): '0' has no effect with use_cpu: true"):
        resolve(host, flags=flags)
    assert resolve(host, flags={"use_cpu": ("true", "--cpu"), "gpu_ids": ("all", "--gpu_ids")})["use_cpu"] is True
