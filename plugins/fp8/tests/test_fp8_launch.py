"""The issue's done-when: ``torchrig launch`` of examples/train_mlp.py with ``--mixed_precision fp8``
and the emulation switch trains on one process and under FSDP2 on 2 CPU ranks, and the log says
how many Linear layers were converted."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.multiprocess

REPO = pathlib.Path(__file__).resolve().parents[3]
TIMEOUT = 240


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("processes, strategy", [("1", "single"), ("2", "fsdp")])
def test_launch_trains_the_example_in_fp8_and_logs_the_converted_layers(tmp_path, process_guard, processes, strategy):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", TORCHRIG_LOG_LEVEL="INFO")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", processes, "--strategy", strategy,
         "--mixed_precision", "fp8", "--fp8_emulate", "--log_dir", str(tmp_path / "logs"),
         str(REPO / "examples" / "train_mlp.py"), "--epochs", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    process_guard.track(proc)
    out, err = proc.communicate(timeout=TIMEOUT)
    text = out + err
    assert proc.returncode == 0, text[-4000:]
    gather = ", FSDP2 fp8 all-gather" if strategy == "fsdp" else ""
    assert (f"fp8: converted 2 of 3 Linear layers of Sequential (recipe tensorwise, emulated{gather}); "
            "skipped: 4 (64x3 features, not multiples of 16)") in text, text[-4000:]
    accuracy = float(text.split("epoch 1: loss")[1].split("accuracy ")[1].split()[0])
    assert accuracy > 0.8, text[-2000:]
    assert f"{processes} process(es), strategy {strategy}" in text
    assert "Failed to load" not in text  # torchao's missing-kernel messages are filtered
