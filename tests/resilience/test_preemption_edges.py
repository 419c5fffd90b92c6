"""Preemption signals at the edges of a run (issue 40, items 14 and 15): a warning that arrives
before the ``Accelerator`` exists, while ``torchrig launch`` is still starting, or while a
checkpoint is being saved or loaded ends the run with a committed checkpoint and exit 75, and
running it again resumes exactly.

Each moment is hit deterministically: the launcher is held at a synchronisation file right after
its entry point's first lines ran, and the training script signals itself at named points.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torchrig.launch.status import RUN_STATUS_FILE

from .test_preemption import RUN_TIMEOUT, _assert_same_training, _checkpoints, _env, _launch, _log, _run, _train

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(6 * RUN_TIMEOUT)]

#: The `torchrig` console script pip writes (import the entry module, call main), with a pause between
#: the two that the test controls: the signal lands after the entry point's first lines, before
#: everything else. Saved as a file named `torchrig`, as the console script is.
HELD_ENTRY = """
import os, sys, time
import torchrig.cli.main as entry
ready, go = sys.argv.pop(1), sys.argv.pop(1)
open(ready, "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
sys.exit(entry.main())
"""


def _held_torchrig(tmp_path: Path) -> str:
    script = tmp_path / "bin" / "torchrig"
    script.parent.mkdir(exist_ok=True)
    script.write_text(HELD_ENTRY)
    return str(script)


def test_sigusr1_while_the_launcher_starts_is_passed_on_and_the_ranks_checkpoint(tmp_path, process_guard):
    ready, go, logs, project = tmp_path / "ready", tmp_path / "go", tmp_path / "logs", tmp_path / "preempted"
    launch = _launch("--log_dir", str(logs), *_train(project))[3:]  # without `python -m torchrig`
    proc = subprocess.Popen([sys.executable, _held_torchrig(tmp_path), str(ready), str(go), *launch], start_new_session=True,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(tmp_path, TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1"))
    process_guard.track(proc)
    deadline = time.monotonic() + RUN_TIMEOUT
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGUSR1)  # the launcher has imported nothing heavy yet, no worker exists
    time.sleep(0.2)  # let it be delivered before the launcher goes on (it is held either way)
    go.touch()
    _, err = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 75, err
    report = json.loads((logs / RUN_STATUS_FILE).read_text())
    assert report["state"] == "preempted" and report["exit_code"] == 75
    assert [r["state"] for r in report["attempts"][-1]["ranks"]] == ["preempted", "preempted"]
    assert _checkpoints(project) == ["checkpoint_0"]
    stopped = {r["preempted"]["step"] for r in report["attempts"][-1]["ranks"]}
    assert stopped == {len(_log(project, 0))} == {len(_log(project, 1))}

    resumed = _run(tmp_path, process_guard, _launch(*_train(project)), TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1")
    assert resumed.returncode == 0, resumed.stderr
    straight = _run(tmp_path, process_guard, _launch(*_train(tmp_path / "straight")))
    assert straight.returncode == 0, straight.stderr
    _assert_same_training(tmp_path / "straight", project, ranks=2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_while_the_launcher_starts_starts_no_worker_and_writes_run_status(tmp_path, process_guard, sig):
    ready, go, logs, project = tmp_path / "ready", tmp_path / "go", tmp_path / "logs", tmp_path / "stopped"
    launch = _launch("--log_dir", str(logs), *_train(project))[3:]
    proc = subprocess.Popen([sys.executable, _held_torchrig(tmp_path), str(ready), str(go), *launch], start_new_session=True,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(tmp_path, TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1,SIGTERM"))
    process_guard.track(proc)
    deadline = time.monotonic() + RUN_TIMEOUT
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(sig)
    time.sleep(0.2)
    go.touch()
    _, err = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 128 + sig, err
    assert f"stopped by {sig.name} before any worker started" in err and "Traceback" not in err
    report = json.loads((logs / RUN_STATUS_FILE).read_text())
    assert report["state"] == "terminated" and report["exit_code"] == 128 + sig
    assert not (project / "log-rank0.jsonl").exists()  # no worker ran


def test_sigusr1_to_a_command_that_launches_nothing_keeps_its_default_action(tmp_path, process_guard):
    ready, go = tmp_path / "ready", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, _held_torchrig(tmp_path), str(ready), str(go), "plugins"], start_new_session=True,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(tmp_path))
    process_guard.track(proc)
    deadline = time.monotonic() + RUN_TIMEOUT
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGUSR1)
    time.sleep(0.2)
    go.touch()
    proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == -signal.SIGUSR1  # held while the command was unknown, then what it always did


def test_sigusr1_before_the_accelerator_exists_under_the_launcher_checkpoints_at_the_first_step(
        tmp_path, process_guard):
    project = tmp_path / "preempted"
    run = _run(tmp_path, process_guard, _launch(*_train(project, "--signal-before-accelerator")),
               TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1")
    assert run.returncode == 75, run.stderr
    assert _checkpoints(project) == ["checkpoint_0"]
    assert len(_log(project, 0)) == len(_log(project, 1)) == 2  # one step to start the agreement, one to read it
    resumed = _run(tmp_path, process_guard, _launch(*_train(project)), TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1")
    assert resumed.returncode == 0, resumed.stderr
    straight = _run(tmp_path, process_guard, _launch(*_train(tmp_path / "straight")))
    assert straight.returncode == 0, straight.stderr
    _assert_same_training(tmp_path / "straight", project, ranks=2)


@pytest.mark.parametrize("warning", ["SIGUSR1", "SIGTERM"])
def test_a_signal_before_the_accelerator_exists_without_a_launcher_checkpoints_at_the_first_step(
        tmp_path, process_guard, warning):
    project = tmp_path / "preempted"
    first = _run(tmp_path, process_guard, [sys.executable, *_train(project, "--signal-before-accelerator",
                                                                   "--signal", warning)],
                 TORCHRIG_PREEMPTION__SIGNALS=warning)
    assert first.returncode == 75, first.stderr
    assert f"preempted by {warning}" in first.stderr and "after optimizer step 1" in first.stderr
    assert _checkpoints(project) == ["checkpoint_0"]
    second = _run(tmp_path, process_guard, [sys.executable, *_train(project)], TORCHRIG_PREEMPTION__SIGNALS=warning)
    assert second.returncode == 0, second.stderr
    straight = _run(tmp_path, process_guard, [sys.executable, *_train(tmp_path / "straight")])
    assert straight.returncode == 0, straight.stderr
    _assert_same_training(tmp_path / "straight", project, ranks=1)


@pytest.mark.parametrize("moment", ["save", "load"])
def test_a_signal_during_save_state_or_load_state_ends_with_a_committed_checkpoint_and_resumes_exactly(
        tmp_path, process_guard, moment):
    """The script signals itself from inside ``save_state`` (a registered object's ``state_dict``)
    or ``load_state`` (its ``load_state_dict``): the checkpoint being written or read is unharmed,
    and the preemption checkpoint follows at the next step boundary."""
    project = tmp_path / "preempted"
    if moment == "load":  # a checkpoint to load first: a run preempted at step 3
        first = _run(tmp_path, process_guard, [sys.executable, *_train(project, "--signal-self-at", "3")],
                     TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1")
        assert first.returncode == 75, first.stderr
    run = _run(tmp_path, process_guard, [sys.executable, *_train(project, f"--signal-during-{moment}",
                                                                 "--save-every", "2")],
               TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1")
    assert run.returncode == 75, run.stderr
    assert "preempted by SIGUSR1" in run.stderr
    resumed = _run(tmp_path, process_guard, [sys.executable, *_train(project)], TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1")
    assert resumed.returncode == 0, resumed.stderr
    straight = _run(tmp_path, process_guard, [sys.executable, *_train(tmp_path / "straight", "--save-every", "2")])
    assert straight.returncode == 0, straight.stderr
    _assert_same_training(tmp_path / "straight", project, ranks=1)
