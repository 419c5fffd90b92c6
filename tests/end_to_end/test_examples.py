"""The example scripts run as a user runs them (`python examples/...`)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def run_example(name: str, *args: str, tmp_path: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env["TORCHRIG_CONFIG_HOME"] = str(tmp_path)  # no machine default file from the developer's machine
    return subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_train_mlp_demo_learns(tmp_path):
    result = run_example("train_mlp.py", "--epochs", "2", "--gradient_accumulation_steps", "2", "--throughput",
                         tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    last_epoch = [line for line in result.stdout.splitlines() if line.startswith("epoch 1:")][0]
    assert "samples/s" in last_epoch and "ms/step" in last_epoch  # the throughput monitor's progress
    accuracy = float(last_epoch.split("accuracy ")[1].split()[0])
    assert accuracy > 0.8, result.stdout
    assert "on 1000 samples" in last_epoch  # gather_for_metrics counted every evaluation sample once
    assert "strategy single" in result.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(360)
def test_seed_002_bert_script_runs_with_only_the_import_changed(tmp_path):
    source = (EXAMPLES / "nlp_example.py").read_text()
    torchrig_lines = [line for line in source.splitlines() if "torchrig" in line and not line.lstrip().startswith("#")]
    assert torchrig_lines == ["from torchrig import Accelerator  # the only torchrig-specific line "
                              "(was: from accelerate import Accelerator)"]
    result = run_example("nlp_example.py", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    losses = [float(line.split("Loss: ")[1]) for line in result.stdout.splitlines() if line.startswith("Epoch")]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert "Training finished!" in result.stdout
