"""notebook_launcher / debug_launcher as a notebook user runs them: a real script (the "notebook")
calls the launcher, which forks real gloo workers through torch's elastic agent.

Each launch runs in its own session with a hard timeout; workers write ``pid-<rank>`` so the process
guard can check by pid that none survives, and their trained parameters so the test can read them back.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent / "notebook_scripts" / "notebook_train.py"
TIMEOUT = 120  # seconds a launch may take before the test gives up (not a measurement)

pytestmark = pytest.mark.multiprocess


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def _launch(tmp_path: Path, guard, mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    tmp = tmp_path / "tmpdir"  # the launch's own temporary directory: it must leave nothing there
    tmp.mkdir()
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), mode, _free_port()], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    guard.track(proc)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    finally:
        for pid_file in tmp_path.glob("pid-*"):
            guard.track(int(pid_file.read_text()))
    # torch elastic's torchelastic_* run directory and torch.multiprocessing's pytorch-errorfile-*.pickle
    # (left by a failing rank) are gone, whether the launch succeeded or failed.
    # torch's per-user compile cache (torchinductor_<user>, made by the training function's own torch) is a
    # cache kept across runs, like pytest's, not something this launch should remove.
    left = sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], "the launch left files in its temporary directory"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _trained(tmp_path: Path) -> list[dict]:
    return [torch.load(tmp_path / f"params-{rank}.pt") for rank in range(2)]


@pytest.mark.parametrize("mode", ["train", "debug"])
def test_launched_function_trains_on_two_processes_with_synchronised_gradients(tmp_path, process_guard, mode):
    result = _launch(tmp_path, process_guard, mode)
    assert result.returncode == 0, result.stderr
    assert "Launching training on 2 CPUs." in result.stdout
    first, second = _trained(tmp_path)
    # Both ranks formed one 2-process gloo group, knew they were forked, and (starting from different
    # seeds and seeing different data) ended with identical parameters: broadcast + all-reduced gradients.
    assert first["world"] == second["world"] == 2
    assert first["fork"] and second["fork"]
    assert first["type"] == "DistributedType.MULTI_CPU"
    assert first["state"].keys() == second["state"].keys() == {"weight", "bias"}
    for name in first["state"]:
        assert torch.equal(first["state"][name], second["state"][name]), name
    process_guard.assert_none_left()


def test_a_failing_rank_is_named_and_no_process_survives(tmp_path, process_guard):
    result = _launch(tmp_path, process_guard, "fail")
    assert result.returncode != 0
    assert "NotebookLaunchError: notebook_launcher: 1 of 2 processes of 'train' failed" in result.stderr
    assert "rank 1 (local rank 1): exit code 1: RuntimeError: boom on rank 1" in result.stderr
    assert not list(tmp_path.glob("params-*"))  # rank 0 was stopped, not left waiting for rank 1
    assert sorted(p.name for p in tmp_path.glob("pid-*")) == ["pid-0", "pid-1"]
    process_guard.assert_none_left()


def test_refuses_to_launch_when_an_accelerator_already_exists_in_the_caller(tmp_path, process_guard):
    result = _launch(tmp_path, process_guard, "twice")
    assert result.returncode != 0
    assert "must only be created inside the launched function" in result.stderr
    assert not list(tmp_path.glob("pid-*"))


def test_bad_arguments_are_refused_before_anything_starts():
    from torchrig.launchers import notebook_launcher

    with pytest.raises(ValueError, match="num_processes=2"):
        notebook_launcher(print)
    with pytest.raises(ValueError, match=r"node_rank \(1\) must be less than num_nodes \(1\)"):
        notebook_launcher(print, num_processes=2, node_rank=1)


def test_one_process_runs_the_function_here(capsys):
    from torchrig.launchers import notebook_launcher

    calls = []
    notebook_launcher(lambda a, b: calls.append((a, b, os.environ.get("TORCHRIG_MIXED_PRECISION"))), args=(1, 2),
                      num_processes=1, mixed_precision="bf16")
    assert calls == [(1, 2, "bf16")]
    assert "TORCHRIG_MIXED_PRECISION" not in os.environ
