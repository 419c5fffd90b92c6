"""notebook_launcher when the training function misbehaves (issue 40, items 12 and 15): whatever the
ranks started is gone the moment the launcher returns or raises, Ctrl-C is a ``KeyboardInterrupt``,
a rank that leaves early or hangs is named and torn down, and only the launcher's own temporary
files are removed.

A real notebook stand-in (``notebook_scripts/notebook_hostile.py``) runs in its own session under a
hard timeout and checks the pids itself right after the launcher returned; the test reads its verdict.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrig.testing.processes import leftover_processes

SCRIPT = Path(__file__).parent / "notebook_scripts" / "notebook_hostile.py"
TIMEOUT = 120  # seconds a launch may take before the test gives up (not a measurement)

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(2 * TIMEOUT)]


def _free_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def _start(tmp_path: Path, guard, mode: str) -> tuple[subprocess.Popen, Path, Path]:
    out, tmp = tmp_path / "out", tmp_path / "tmpdir"
    out.mkdir()
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(out), mode, _free_port()], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    guard.track(proc)
    return proc, out, tmp


def _finish(proc: subprocess.Popen, out: Path, tmp: Path, guard) -> dict:
    try:
        _, err = proc.communicate(timeout=TIMEOUT)
    finally:
        for name in ("pid-*", "children-*"):
            for path in out.glob(name):
                for pid in path.read_text().split():
                    guard.track(int(pid))
    assert proc.returncode == 0 and (out / "result.json").exists(), err
    left = sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))
    assert left == [], "the launch left files in its temporary directory"
    result = json.loads((out / "result.json").read_text())
    result["stderr"] = err
    return result


def _run(tmp_path: Path, guard, mode: str) -> dict:
    proc, out, tmp = _start(tmp_path, guard, mode)
    return _finish(proc, out, tmp, guard)


def test_processes_the_ranks_started_are_gone_when_the_launcher_returns(tmp_path, process_guard):
    result = _run(tmp_path, process_guard, "return")
    assert result["raised"] is None, result
    assert result["alive"] == [], "ranks, or processes they started, outlived notebook_launcher"
    assert result["sigint_handler_is_pythons"]
    process_guard.assert_none_left()


@pytest.mark.parametrize("mode", ["raise", "raise_past_sigterm"])
def test_processes_the_ranks_started_are_gone_when_a_rank_raises(tmp_path, process_guard, mode):
    result = _run(tmp_path, process_guard, mode)
    assert result["raised"] == "NotebookLaunchError", result
    assert "rank 1 (local rank 1): exit code 1: RuntimeError: boom on rank 1" in result["message"]
    assert result["alive"] == []
    assert result["sigint_handler_is_pythons"]
    process_guard.assert_none_left()


def _wait_ready(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not all((out / f"{what}-{rank}").exists() for what in ("ready", "children") for rank in (0, 1)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the ranks never became ready"
        time.sleep(0.05)


def test_ctrl_c_in_the_notebook_is_a_keyboard_interrupt_and_leaves_nothing_running(tmp_path, process_guard):
    proc, out, tmp = _start(tmp_path, process_guard, "sleep")
    _wait_ready(proc, out)
    proc.send_signal(signal.SIGINT)  # Jupyter's "interrupt the kernel": SIGINT to the kernel process only
    result = _finish(proc, out, tmp, process_guard)
    assert result["raised"] == "KeyboardInterrupt", result
    assert sorted(p.name for p in out.glob("interrupted-*")) == ["interrupted-0", "interrupted-1"]  # not torch's
    assert result["alive"] == []
    assert result["sigint_handler_is_pythons"], "the next Ctrl-C in the notebook would raise torch's SignalException"
    process_guard.assert_none_left()


@pytest.mark.parametrize("how", ["sys_exit0", "os_exit0"])
def test_a_rank_that_leaves_the_function_early_is_named_and_the_others_torn_down(tmp_path, process_guard, how):
    result = _run(tmp_path, process_guard, how)
    assert result["raised"] == "NotebookLaunchError", result
    assert "rank 1 (local rank 1): exited with code 0 without returning from 'train'" in result["message"]
    assert "rank 0 (local rank 0)" not in result["message"]  # torn down, not blamed
    assert result["alive"] == []
    process_guard.assert_none_left()


def test_a_rank_that_calls_sys_exit_with_an_error_code_is_named_with_it(tmp_path, process_guard):
    result = _run(tmp_path, process_guard, "sys_exit3")
    assert result["raised"] == "NotebookLaunchError", result
    assert "rank 1 (local rank 1): exit code 3: no Python exception" in result["message"]
    assert "rank 0 (local rank 0)" not in result["message"]
    assert result["alive"] == []
    process_guard.assert_none_left()


def test_a_hanging_rank_is_torn_down_when_its_peer_times_out(tmp_path, process_guard):
    result = _run(tmp_path, process_guard, "hang")
    assert result["raised"] == "NotebookLaunchError", result
    assert "rank 0 (local rank 0)" in result["message"]
    assert result["alive"] == []
    process_guard.assert_none_left()


def test_a_temporary_directory_another_thread_made_during_the_launch_is_kept(tmp_path, process_guard):
    result = _run(tmp_path, process_guard, "tempdir")
    assert result["raised"] is None, result
    assert result["other_thread_dir_exists"], "notebook_launcher removed a directory it did not make"
    assert result["alive"] == []


def test_ctrl_c_again_and_again_during_the_teardown_still_leaves_nothing_running(tmp_path, process_guard):
    """The ranks ignore SIGINT and SIGTERM, so each teardown waits for the supervisors' kill grace
    (5 s); the user presses Ctrl-C three times meanwhile, interrupting torch's teardown and then
    its second teardown."""
    proc, out, tmp = _start(tmp_path, process_guard, "sleep_past_stop_signals")
    _wait_ready(proc, out)
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)  # well inside the supervisors' grace: the teardown is still waiting
    result = _finish(proc, out, tmp, process_guard)
    assert result["raised"] == "KeyboardInterrupt", result
    assert result["alive"] == []
    assert result["sigint_handler_is_pythons"]
    process_guard.assert_none_left()


def test_kill_9_of_the_notebook_takes_the_ranks_and_everything_they_started_with_it(tmp_path, process_guard):
    proc, out, _ = _start(tmp_path, process_guard, "sleep")
    _wait_ready(proc, out)
    started = [int(pid) for name in ("pid-*", "children-*") for path in out.glob(name) for pid in path.read_text().split()]
    for pid in started:
        process_guard.track(pid)
    proc.kill()
    proc.communicate(timeout=TIMEOUT)
    deadline = time.monotonic() + 10  # the kernel's parent-death signal, then each supervisor's sweep
    while leftover_processes(started, reap=False) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftover_processes(started, reap=False) == [], "processes outlived the notebook"
