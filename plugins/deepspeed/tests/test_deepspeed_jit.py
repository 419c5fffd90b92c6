"""DeepSpeed's JIT-compiled ops under ``torchrig launch``/``torchrig test``: a stale compile lock (left by a
killed compile) made every later run wait forever inside ``deepspeed.initialize`` without a word, and the
launcher's summary then said only "stopped by SIGTERM" (``torchrig test``: "a check failed"). Now the first run
says what it compiles and how to build it ahead, a rank stuck on a lock names it (stderr and its status), the
summary of the stopped run names it, and ``torchrig build-deepspeed-ops`` compiles the op ahead of a job,
refusing a stale lock by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.utils.cpp_extension import _get_build_directory

OP = "deepspeed_shm_comm"


def test_the_extensions_directory_is_the_one_torch_builds_in(tmp_path, monkeypatch):
    """The watcher looks where torch's cpp_extension builds: fails loudly if torch moves it."""
    from torchrig_deepspeed.jit_ops import extensions_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert extensions_directory() / OP == Path(_get_build_directory(OP, verbose=False))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_directory() / OP == Path(_get_build_directory(OP, verbose=False))


@pytest.mark.multiprocess
def test_a_stale_compile_lock_is_named_on_stderr_in_the_status_and_in_the_summary(tmp_path):
    """Through ``torchrig test --use_deepspeed`` (a launch of the sanity script): the wait is named on stderr,
    in the rank's status and in the launcher's summary, and ``torchrig test`` says it was stopped, not that a
    check failed."""
    extensions = tmp_path / "extensions"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRIG_", "DS_ACCELERATOR"))}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", TORCH_EXTENSIONS_DIR=str(extensions))
    lock = _stale_lock(env)
    config = tmp_path / "run.yaml"
    config.write_text("deepspeed_config:\n  jit_lock_warning_seconds: 1\n")
    command = [sys.executable, "-m", "torchrig", "test", "--cpu", "--num_processes", "1", "--use_deepspeed",
               "--config_file", str(config)]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=tmp_path, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and launcher.poll() is None:
            if any(f"rank 0 is waiting on {lock}" in line for line in lines):
                break
            time.sleep(0.5)
        assert launcher.poll() is None, "the run ended although the lock was never released"
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
        reader.join(timeout=30)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    err = "".join(lines)
    assert launcher.returncode == 143, err[-3000:]
    assert f"DeepSpeed compiles its op {OP} on its first use" in err  # said before anything is compiled
    assert "torchrig build-deepspeed-ops" in err  # ... with how to build it ahead of a job
    assert f"rank 0 is waiting on {lock}" in err and f"rm {lock}" in err  # the rank's own message
    summary = err[err.index("torchrig launch: TERMINATED"):]
    assert f"waited on something: rank 0 is waiting on {lock}" in summary.splitlines()[0]
    last = err.strip().splitlines()[-1]
    assert last.startswith("torchrig test: stopped before its checks finished") and "a check failed" not in err, last
    logs = Path(last.rpartition(" kept in ")[2])
    report = json.loads((logs / "run_status.json").read_text())
    assert str(lock) in report["headline"] and str(lock) in report["ranks"][0]["waiting"]
    _no_process_left(launcher.pid)


def _build_ops(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchrig", "build-deepspeed-ops", *args], capture_output=True,
                          text=True, env=env, timeout=900, start_new_session=True)


@pytest.mark.multiprocess
def test_build_deepspeed_ops_refuses_a_stale_lock_and_an_unknown_op_by_name(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRIG_", "DS_ACCELERATOR"))}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1",
               TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    lock = _stale_lock(env)
    stale = _build_ops(env)
    assert stale.returncode == 1, stale.stderr[-3000:]
    assert f"{lock} has been left for" in stale.stderr and f"rm {lock}" in stale.stderr
    assert "Traceback" not in stale.stderr and not (lock.parent / f"{OP}.so").exists()
    unknown = _build_ops(env, "cpu_adamm")
    assert unknown.returncode == 2 and "unknown DeepSpeed op(s) cpu_adamm" in unknown.stderr, unknown.stderr[-3000:]
    assert "cpu_adam" in unknown.stderr.rpartition("DeepSpeed's ops:")[2] and "Traceback" not in unknown.stderr


@pytest.mark.slow
def test_build_deepspeed_ops_compiles_the_op_a_run_would_compile_and_then_skips_it(tmp_path):
    """The effect: the op's library appears in the extensions directory named, and the next call (as a run's
    start) finds it built. Slow: a real compile (30 s on two idle cores, minutes on a loaded machine)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRIG_", "DS_ACCELERATOR", "TORCH_EXT"))}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    extensions = tmp_path / "extensions"
    first = _build_ops(env, "--extensions_dir", str(extensions))
    assert first.returncode == 0, first.stderr[-3000:]
    library = extensions / OP / f"{OP}.so"
    assert library.exists() and f"{OP}: compiling into {extensions / OP}" in first.stdout
    assert f"{OP}: built in" in first.stdout
    again = _build_ops({**env, "TORCH_EXTENSIONS_DIR": str(extensions)})
    assert again.returncode == 0 and f"{OP}: built already ({library})" in again.stdout, again.stdout + again.stderr


def test_the_watcher_reports_a_stalled_lock_once_and_clears_it_when_the_wait_ends(tmp_path):
    from torchrig.resilience import run_status
    from torchrig_deepspeed.jit_ops import LockWatcher

    busy, stuck = tmp_path / "busy_op", tmp_path / "stuck_op"
    for build in (busy, stuck):
        build.mkdir()
        (build / "lock").touch()
    old = time.time() - 3600
    for path in (stuck / "lock", stuck):
        os.utime(path, (old, old))
    status = run_status.RankStatus(tmp_path / "rank-0.status.json")
    run_status._set_current(status)
    try:
        with LockWatcher(3, tmp_path, patience=0.5) as watcher:
            deadline = time.monotonic() + 30
            while not (recorded := json.loads(status.path.read_text()).get("waiting")) and time.monotonic() < deadline:
                (busy / "build.ninja").write_text(str(time.monotonic()))  # a compile in progress writes here
                time.sleep(0.1)
        assert watcher.reported == {stuck / "lock"}  # the busy build's lock is a compile at work, not a stall
        assert recorded.startswith(f"rank 3 is waiting on {stuck / 'lock'}")
        assert json.loads(status.path.read_text())["waiting"] is None  # the wait ended: the record is cleared
    finally:
        run_status._set_current(None)


def _stale_lock(env: dict[str, str]):
    """The lock file a killed compile leaves: torch's FileBaton, in the op's build directory."""
    build = subprocess.run([sys.executable, "-c", "from torch.utils.cpp_extension import _get_build_directory as d; "
                            f"print(d({OP!r}, verbose=False))"], env=env, capture_output=True, text=True, timeout=120)
    assert build.returncode == 0, build.stderr
    lock = Path(build.stdout.strip()) / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    os.utime(lock.parent, (old, old))
    return lock


def _no_process_left(session: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _session_of(int(pid)) == session]
        if not left:
            return
        time.sleep(0.2)
    raise AssertionError(f"processes of the launch survived: {left}")


def _session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None
