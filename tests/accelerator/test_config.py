"""The Accelerator reads the configuration itself: `python train.py`, `torchrun train.py` and
`torchrig launch train.py` see the same values, and a bad configuration fails on every rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from torchrig import Accelerator, DataLoaderConfiguration, GradScalerKwargs, ProjectConfiguration
from torchrig.config.readers import encode_launch_overrides
from torchrig.config.resolve import ConfigOverrideWarning
from torchrig.errors import ConfigError

SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("always")
    from torchrig import Accelerator
    accelerator = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=3)
    print(json.dumps({
        "rank": accelerator.process_index,
        "world": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "mixed_precision_source": str(accelerator.config.source("mixed_precision")),
        "steps": accelerator.gradient_accumulation_steps,
        "device": str(accelerator.device),
        "strategy": accelerator.strategy,
    }))
    """
)


@pytest.fixture
def isolated_env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env["TORCHRIG_CONFIG_HOME"] = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    return env


def run_script(tmp_path, env, *prefix):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    return subprocess.run([*prefix, str(script)], capture_output=True, text=True, timeout=180, env=env)


@pytest.mark.multiprocess
def test_python_train_py_reads_every_layer_in_order(tmp_path, isolated_env):
    home = tmp_path / "home" / "default_config.yaml"
    home.write_text("mixed_precision: 'no'\ngradient_accumulation_steps: 2\nuse_cpu: true\n")
    # Default file < script argument: the script's bf16 survives the machine's 'no'.
    out = run_script(tmp_path, isolated_env, sys.executable)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["mixed_precision"] == "bf16" and result["mixed_precision_source"] == "argument Accelerator(mixed_precision=...)"
    assert result["steps"] == 3 and result["device"] == "cpu" and result["world"] == 1 and result["strategy"] == "single"

    # Script argument < the run's config file (with a warning naming both).
    run_file = tmp_path / "run.yaml"
    run_file.write_text("mixed_precision: fp16\n")
    env = {**isolated_env, "TORCHRIG_CONFIG_FILE": str(run_file)}
    out = run_script(tmp_path, env, sys.executable)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["mixed_precision"] == "fp16"
    assert "ConfigOverrideWarning" in out.stderr and "run.yaml:1:1" in out.stderr and "'bf16'" in out.stderr

    # Config file < launch flag.
    env["TORCHRIG_LAUNCH_OVERRIDES"] = encode_launch_overrides({"mixed_precision": ("no", "--mixed_precision")})
    out = run_script(tmp_path, env, sys.executable)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (result["mixed_precision"], result["mixed_precision_source"]) == ("no", "flag --mixed_precision")


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bad_config_fails_on_every_rank_before_any_process_group(tmp_path, isolated_env, process_guard):
    """Two ranks with torch elastic's variables (as torchrun sets them) and a bad config file:
    both fail with the same message. Had either tried to create the process group first, it
    would wait for a rendezvous nobody serves and the test would time out."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nobody listens here
    run_file = tmp_path / "bad.yaml"
    run_file.write_text("mixed_precison: bf16\n")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    procs = []
    for rank in range(2):
        env = {**isolated_env, "TORCHRIG_CONFIG_FILE": str(run_file), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        process_guard.track(proc)
        procs.append(proc)
    messages = []
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 1
        messages.append(err.strip().splitlines()[-1])
    assert messages[0] == messages[1]
    assert "mixed_precison (" in messages[0] and "bad.yaml:1:1" in messages[0]
    assert "did you mean 'mixed_precision'" in messages[0]


def test_accelerator_arguments_map_to_sections(tmp_path, isolated_env, monkeypatch):
    for key in [k for k in os.environ if k.startswith("TORCHRIG_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", isolated_env["TORCHRIG_CONFIG_HOME"])
    accelerator = Accelerator(
        cpu=True,
        project_dir=tmp_path / "proj",
        dataloader_config=DataLoaderConfiguration(even_batches=False),
        split_batches=True,
        kwargs_handlers=[GradScalerKwargs(init_scale=8.0)],
        dynamo_backend="INDUCTOR",
    )
    config = accelerator.config
    assert config["use_cpu"] is True
    assert config["project_config.project_dir"] == str(tmp_path / "proj")
    assert (config["dataloader_config.even_batches"], config["dataloader_config.split_batches"]) == (False, True)
    assert config["grad_scaler_kwargs.init_scale"] == 8.0
    assert config["dynamo_config.backend"] == "inductor"
    assert accelerator.logging_dir == str(tmp_path / "proj")
    assert Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir="p", logging_dir="logs")).logging_dir == os.path.join("p", "logs")


def test_unsupported_and_unknown_arguments_are_errors(monkeypatch, isolated_env):
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", isolated_env["TORCHRIG_CONFIG_HOME"])
    with pytest.raises(ConfigError) as excinfo:
        Accelerator(megatron_lm_plugin=object(), kwargs_handlers=[object()])
    text = str(excinfo.value)
    assert "Megatron-LM is not supported" in text and "kwargs_handlers[0]" in text
    with pytest.raises(TypeError):
        Accelerator(mixed_precison="bf16")  # a typo'd keyword is Python's own TypeError


def test_two_handlers_for_one_section_are_refused_naming_both(monkeypatch, isolated_env):
    """Accelerate raises on two handlers of one kind; keeping the last silently dropped the first."""
    from torchrig import DistributedDataParallelKwargs, GradientAccumulationPlugin

    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", isolated_env["TORCHRIG_CONFIG_HOME"])
    with pytest.raises(ConfigError) as excinfo:
        Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=10), GradScalerKwargs(),
                                               DistributedDataParallelKwargs(find_unused_parameters=True)])
    text = str(excinfo.value)
    assert "kwargs_handlers[0]" in text and "kwargs_handlers[2]" in text and "DistributedDataParallelKwargs" in text
    assert "kwargs_handlers[1]" not in text
    second = r"kwargs_handlers\[0\]\): a second GradientAccumulationPlugin .*gradient_accumulation_plugin=\.\.\.\) already"
    with pytest.raises(ConfigError, match=second):
        Accelerator(cpu=True, gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=2),
                    kwargs_handlers=[GradientAccumulationPlugin(num_steps=4)])


def test_override_warning_is_a_python_warning(tmp_path, monkeypatch, isolated_env):
    run_file = tmp_path / "run.yaml"
    run_file.write_text("gradient_accumulation_steps: 8\n")
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", isolated_env["TORCHRIG_CONFIG_HOME"])
    monkeypatch.setenv("TORCHRIG_CONFIG_FILE", str(run_file))
    with pytest.warns(ConfigOverrideWarning, match="gradient_accumulation_steps"):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    assert accelerator.gradient_accumulation_steps == 8
    with pytest.raises(ConfigError, match="strict_config is on"):
        Accelerator(cpu=True, gradient_accumulation_steps=2, strict_config=True)


def test_a_forced_device_that_is_not_there_is_an_error_naming_it(monkeypatch, isolated_env):
    """TORCHRIG_DEVICE=cuda (or --device cuda) without CUDA trained on the CPU, exit 0, nothing said."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the forced device is there")
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", isolated_env["TORCHRIG_CONFIG_HOME"])
    monkeypatch.setenv("TORCHRIG_DEVICE", "cuda")
    with pytest.raises(ConfigError, match=r"device \(environment TORCHRIG_DEVICE\): 'cuda' was asked for, but the "
                                          r"device plugin 'cuda' found no such device on this machine"):
        Accelerator()
    monkeypatch.setenv("TORCHRIG_DEVICE", "cpu")
    assert Accelerator().device.type == "cpu"
