"""Hostile inputs to configuration, launch and trackers (issue 18, items 9, 10, 11, 13, 15, 16).

Each test reproduces one defect as an adversarial user met it; each failed on the code before
its fix. Multi-process tests run real ``torchrig launch`` processes (each in its own session,
tracked by the process guard) with hard timeouts, as in ``tests/launch/test_launch.py``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from torchrig import Accelerator, Tracker
from torchrig.config.loader import load_file
from torchrig.config.readers import encode_launch_overrides
from torchrig.config.resolve import ConfigOverrideWarning, resolve_config
from torchrig.errors import ConfigError
from torchrig.launch import summary as launch_summary
from torchrig.testing import make_host
from torchrig.testing.processes import leftover_processes

SCRIPTS = Path(__file__).parent / "launch_scripts"
CLI_TIMEOUT = 60  # seconds a CLI call may take before the test gives up (not a measurement)
LAUNCH_TIMEOUT = 120
CONFIG_LIMIT = 1 << 20  # the documented size limit of a config file (1 MiB)


@pytest.fixture(scope="module")
def host():
    return make_host()


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1", **extra)
    return env


def _cli(tmp_path: Path, guard, *args: str, timeout: float = CLI_TIMEOUT) -> tuple[int, str, str]:
    proc = subprocess.Popen([sys.executable, "-m", "torchrig", *args], start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(tmp_path))
    guard.track(proc)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _resolve(host, **kwargs):
    kwargs.setdefault("environ", {})
    kwargs.setdefault("flags", {})
    kwargs.setdefault("default_file", False)
    return resolve_config(host, **kwargs)


# -- 9: equal values are not overrides ----------------------------------------------------------


@pytest.mark.parametrize("source", [
    {"environ": {"TORCHRIG_USE_CPU": "true"}},
    {"flags": {"use_cpu": ("true", "--cpu")}},
    {"environ": {"TORCHRIG_LAUNCH_OVERRIDES": encode_launch_overrides({"use_cpu": ("true", "--cpu")})},
     "flags": None},
])
def test_an_equal_value_from_env_or_flag_is_not_an_override_of_the_script(host, source):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigOverrideWarning)
        config = _resolve(host, arguments={"cpu": True, "strict_config": True}, **source)
    assert config["use_cpu"] is True and config.warnings == ()


def test_equal_steps_from_a_flag_pass_strict_config_but_a_different_value_still_fails(host):
    flags = {"gradient_accumulation_steps": ("2", "--gradient_accumulation_steps")}
    config = _resolve(host, arguments={"gradient_accumulation_steps": 2, "strict_config": True}, flags=flags)
    assert config["gradient_accumulation_steps"] == 2 and config.warnings == ()
    flags = {"gradient_accumulation_steps": ("3", "--gradient_accumulation_steps")}
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps: the script's .* = 2 is overridden by "
                                          r"flag --gradient_accumulation_steps = '3' \(strict_config is on\)"):
        _resolve(host, arguments={"gradient_accumulation_steps": 2, "strict_config": True}, flags=flags)


# -- 11: non-finite floats ----------------------------------------------------------------------


@pytest.mark.parametrize("text, key", [
    ("init_process_group_kwargs:\n  timeout: .nan\n", "init_process_group_kwargs.timeout"),
    ("grad_scaler_kwargs:\n  init_scale: .inf\n", "grad_scaler_kwargs.init_scale"),
    ("grad_scaler_kwargs:\n  growth_factor: -.inf\n", "grad_scaler_kwargs.growth_factor"),
])
def test_nan_and_inf_in_a_config_file_are_rejected_by_validate_naming_the_key(tmp_path, process_guard, text, key):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    code, out, err = _cli(tmp_path, process_guard, "config", "validate", str(path))
    assert code == 2, (out, err)
    assert key in err and "finite number" in err, err
    assert "Traceback" not in err


def test_nan_passed_from_python_is_rejected_naming_the_key(host):
    with pytest.raises(ConfigError, match=r"grad_scaler_kwargs.backoff_factor.*finite number, got nan"):
        _resolve(host, arguments={"grad_scaler_kwargs": {"backoff_factor": float("nan")}})


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("flag", ["--monitor_interval", "--shutdown_grace", "--preflight_timeout"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_launcher_flags_exit_2_before_anything_starts(tmp_path, process_guard, flag, value):
    script = tmp_path / "touch.py"
    script.write_text("import pathlib, sys\npathlib.Path(sys.argv[1]).write_text('started')\n")
    marker = tmp_path / "started"
    code, _, err = _cli(tmp_path, process_guard, "launch", "--num_processes", "1", "--log_dir", str(tmp_path / "logs"),
                        flag, value, str(script), str(marker))
    assert code == 2, err
    assert flag in err and "finite" in err and "Traceback" not in err, err
    assert not marker.exists() and not (tmp_path / "logs").exists()


# -- 13: config files must be small regular files -----------------------------------------------


def test_a_character_device_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match=r"/dev/zero: is a character device, not a regular file"):
        load_file("/dev/zero")


def test_a_config_file_over_the_size_limit_is_refused_naming_the_limit(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("# padding\n" * (CONFIG_LIMIT // 10 + 1))
    with pytest.raises(ConfigError, match=rf"huge.yaml: is {path.stat().st_size} bytes; config files are limited "
                                          rf"to {CONFIG_LIMIT} bytes \(1 MiB\)"):
        load_file(path)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_config_file_dev_zero_exits_2_without_a_traceback(tmp_path, process_guard):
    code, _, err = _cli(tmp_path, process_guard, "launch", "--config_file", "/dev/zero", "--dry-run")
    assert code == 2, err
    assert "/dev/zero: is a character device, not a regular file" in err and "Traceback" not in err, err


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
def test_extends_naming_a_device_or_a_fifo_fails_at_once_naming_both_files(tmp_path, process_guard, target):
    if target == "fifo":
        os.mkfifo(tmp_path / "fifo")
    run = tmp_path / "run.yaml"
    run.write_text(f"extends: {target}\nmixed_precision: 'no'\n")
    started = time.monotonic()
    code, _, err = _cli(tmp_path, process_guard, "config", "validate", str(run), timeout=30)
    assert code == 2, err
    kind = "a FIFO" if target == "fifo" else "a character device"
    assert f"is {kind}, not a regular file" in err and "extended by" in err and "run.yaml:1" in err, err
    assert "Traceback" not in err
    assert time.monotonic() - started < 30


def test_a_symlink_to_a_regular_file_is_still_read(tmp_path):
    real = tmp_path / "real.yaml"
    real.write_text("mixed_precision: fp16\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    assert load_file(link).data == {"mixed_precision": "fp16"}


# -- 16: a tracker thread that dies is reported; every event is delivered or counted ------------


class _ExitsOnLog(Tracker):
    """``log`` calls ``sys.exit`` on every other call, as a misbehaving library might."""

    name = "exits_on_log"

    def __init__(self):
        super().__init__()
        self.calls = 0

    def log(self, values, step, **kwargs):
        self.calls += 1
        if self.calls % 2:
            sys.exit(3)


class _RaisesOnLog(Tracker):
    name = "raises_on_log"

    def log(self, values, step, **kwargs):
        raise ConnectionError("server unreachable")


class _ExitingHandler(logging.Handler):
    """A logging handler that ends the thread that logs: the tracker's own warning kills it."""

    def emit(self, record):
        if threading.current_thread().name.startswith("torchrig-tracker-"):
            raise SystemExit("a logging handler exited")


def _log_events(tmp_path: Path, tracker: Tracker, events: int) -> dict:
    accelerator = Accelerator(cpu=True, log_with=["jsonl", tracker], project_dir=str(tmp_path / "project"))
    accelerator.init_trackers("demo")
    for step in range(events):
        accelerator.log({"loss": float(step)}, step=step)
    return accelerator.end_training()


@pytest.mark.timeout(60)
def test_a_tracker_whose_log_calls_sys_exit_has_every_event_counted_and_is_reported(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="torchrig.tracking"):
        report = _log_events(tmp_path, _ExitsOnLog(), 30)
    row = report["exits_on_log"]
    assert report["jsonl"]["delivered"] == 31  # the configuration, then 30 log events
    assert row["delivered"] + row["dropped"] == 31, row  # every event accounted for
    assert (row["delivered"], row["failed"], row["errors"]) == (16, 15, 15), row
    assert row["last_error"] == "SystemExit: 3" and row["state"] == "finished"
    assert any("tracker 'exits_on_log' finished: delivered 16 events, dropped 15 (15 failed: steps 0, 2, 4" in r.getMessage()
               for r in caplog.records)


@pytest.mark.timeout(60)
def test_a_tracker_thread_that_dies_is_reported_as_crashed_and_later_events_are_counted(tmp_path, caplog):
    handler = _ExitingHandler()
    logging.getLogger("torchrig.tracking").addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="torchrig.tracking"):
            report = _log_events(tmp_path, _RaisesOnLog(), 20)
    finally:
        logging.getLogger("torchrig.tracking").removeHandler(handler)
    row = report["raises_on_log"]
    assert row["state"] == "crashed", row
    assert row["delivered"] + row["dropped"] == report["jsonl"]["delivered"] == 21, row
    assert row["crashed"] >= 1 and "its thread died: SystemExit: a logging handler exited" in row["last_error"], row
    assert any("tracker 'raises_on_log' crashed" in r.getMessage() for r in caplog.records)


# -- 15: a rank that leaves early is the cause, not the rank left waiting -----------------------


def _launch(tmp_path: Path, guard, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "torchrig", "launch", *args], start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(tmp_path))
    guard.track(proc)
    return proc


def _track_workers(out: Path, guard) -> None:
    for ready in out.glob("ready-*"):
        if ready.read_text():
            guard.track(int(ready.read_text()))


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_TIMEOUT)
def test_a_rank_that_exits_0_while_the_others_wait_is_named_as_the_cause(tmp_path, process_guard):
    out, log_dir = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    proc = _launch(tmp_path, process_guard, "--num_processes", "2", "--log_dir", str(log_dir),
                   str(SCRIPTS / "early_exit.py"), str(out))
    _, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    _track_workers(out, process_guard)
    assert proc.returncode == 1, err
    status = json.loads((log_dir / "run_status.json").read_text())
    assert (status["culprit"], status["reason"]) == (1, "left early"), err
    assert "torchrig launch: FAILED: rank 1 exited (code 0) while the other ranks still needed it" in err, err
    assert "rank 0: also failed after losing a peer, waiting for rank 1" in err, err
    assert "rank 1: left early" in err, err


def _record(rank, state, ended_at, error=None, exit_code=1):
    return {"rank": rank, "state": state, "ended_at": ended_at, "error": error, "traceback": None,
            "exit_code": exit_code, "signal": None}


@pytest.mark.parametrize("error", ["RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:8094",
                                   "RuntimeError: Timed out waiting 3000ms for recv operation to complete"])
def test_analysis_names_the_rank_that_finished_before_the_others_failed_waiting(error):
    records = [_record(0, "failed", 10.5, error), _record(1, "finished", 10.0, exit_code=0),
               _record(2, "failed", 10.6, error)]
    verdict = launch_summary.analyze(records)
    assert (verdict["state"], verdict["culprit"], verdict["reason"]) == ("failed", 1, "left early")
    text = launch_summary.format_summary(verdict, records)
    assert text.splitlines()[1] == "  rank 1: left early: exited with code 0 while the other ranks still waited for it"
    # a rank that finished *after* the failure, or a failure of its own, is not blamed on a finisher
    late = [_record(0, "failed", 10.5, error), _record(1, "finished", 10.7, exit_code=0)]
    assert launch_summary.analyze(late)["culprit"] == 0
    own = [_record(0, "failed", 10.5, "ValueError: bad batch"), _record(1, "finished", 10.0, exit_code=0)]
    assert launch_summary.analyze(own)["culprit"] == 0


# -- 10: nothing a rank started outlives the launcher, not even after kill -9 -------------------


def _wait_for(paths: list[Path], proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while not all(p.exists() for p in paths):
        assert proc.poll() is None or all(p.exists() for p in paths), f"launcher ended early: {proc.communicate()}"
        assert time.monotonic() < deadline, "workers never became ready"
        time.sleep(0.05)


def _alive_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while True:
        alive = leftover_processes(pids, reap=False)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


@pytest.mark.multiprocess
@pytest.mark.timeout(LAUNCH_TIMEOUT)
@pytest.mark.parametrize("how", ["kill -9 launcher", "SIGTERM launcher", "rank returns"])
def test_processes_a_rank_started_die_with_it_even_when_the_launcher_is_killed(tmp_path, process_guard, how):
    out = tmp_path / "out"
    out.mkdir()
    mode = "exit" if how == "rank returns" else "sleep"
    proc = _launch(tmp_path, process_guard, "--num_processes", "2", "--log_dir", str(tmp_path / "logs"),
                   str(SCRIPTS / "spawn_tree.py"), str(out), mode)
    _wait_for([out / f"children-{r}" for r in (0, 1)] + [out / f"ready-{r}" for r in (0, 1)], proc)
    children = [int(p) for r in (0, 1) for p in (out / f"children-{r}").read_text().split()]
    ranks = [int((out / f"ready-{r}").read_text()) for r in (0, 1)]
    for pid in children + ranks:
        process_guard.track(pid)
    if how != "rank returns":
        assert leftover_processes(children, reap=False) == children  # all six are running
        proc.send_signal(signal.SIGKILL if how == "kill -9 launcher" else signal.SIGTERM)
    proc.communicate(timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == {"kill -9 launcher": -9, "SIGTERM launcher": 143, "rank returns": 0}[how]
    assert _alive_within(ranks + children, 10.0) == [], "processes outlived their rank"
