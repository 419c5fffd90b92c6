"""Preemption (issue 22): a scheduler's warning signal becomes a committed checkpoint at a step
every rank agrees on, the job exits 75 without a restart, and running it again resumes exactly.

The training script (``preemption_scripts/preemptible_train.py``) never mentions preemption: it is
configured from outside (``TORCHRIG_PREEMPTION__SIGNALS``), as a user would turn it on for a job
that already checkpoints. "Exactly" means the final parameters of an interrupted-and-resumed run
are ``torch.equal`` to those of a straight run, and every rank saw the same samples.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrig import Accelerator
from torchrig.config.options import ProjectConfiguration
from torchrig.config.resolve import resolve_config
from torchrig.errors import ConfigError
from torchrig.launch.status import RUN_STATUS_FILE
from torchrig.resilience import preemption
from torchrig.testing import make_host

SCRIPT = Path(__file__).parent / "preemption_scripts" / "preemptible_train.py"
RUN_TIMEOUT = 120  # seconds a run may take before the test gives up (not a measurement)
STEPS = 16


@pytest.fixture(autouse=True)
def _forget_requests():
    yield
    preemption.reset()


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1", **extra)
    return env


def _run(tmp_path: Path, guard, command: list[str], **env: str) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(command, start_new_session=True, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=_env(tmp_path, **env))
    guard.track(proc)
    out, err = proc.communicate(timeout=RUN_TIMEOUT)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _train(project: Path, *args: str) -> list[str]:
    project.mkdir(exist_ok=True)
    return [str(SCRIPT), str(project), "--steps", str(STEPS), *args]


def _launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "torchrig", "launch", "--num_processes", "2", *args]


def _params(project: Path) -> dict[str, torch.Tensor]:
    return torch.load(project / "final.pt")["params"]


def _assert_same_training(straight: Path, resumed: Path, ranks: int) -> None:
    a, b = _params(straight), _params(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs after preemption and resume"
    for rank in range(ranks):
        seen = [(e["step"], e["samples"]) for e in _log(straight, rank)]
        assert [(e["step"], e["samples"]) for e in _log(resumed, rank)] == seen


def _log(project: Path, rank: int) -> list[dict]:
    path = project / f"log-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _checkpoints(project: Path) -> list[str]:
    folder = project / "checkpoints"
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("checkpoint_")) if folder.exists() else []


# ---------------------------------------------------------------- configuration (no process)


def test_signal_names_are_normalised_and_unknown_ones_named(tmp_path):
    host = make_host()
    config = resolve_config(host, environ={"TORCHRIG_PREEMPTION__SIGNALS": "usr1,term"}, flags={}, default_file=False)
    assert config.section("preemption").signals == ["SIGUSR1", "SIGTERM"]
    with pytest.raises(ConfigError) as excinfo:
        resolve_config(host, environ={"TORCHRIG_PREEMPTION__SIGNALS": "SIGKILL"}, flags={}, default_file=False)
    assert "TORCHRIG_PREEMPTION__SIGNALS" in str(excinfo.value) and "SIGUSR1" in str(excinfo.value)


def test_preemption_without_automatic_checkpoints_is_refused_naming_the_keys(monkeypatch):
    monkeypatch.setenv("TORCHRIG_PREEMPTION__SIGNALS", "SIGUSR1")
    with pytest.raises(ConfigError) as excinfo:
        Accelerator(cpu=True)
    message = str(excinfo.value)
    assert "preemption.signals" in message and "automatic_checkpoint_naming" in message
    assert preemption.installed_signals() == []  # nothing armed by a refused configuration


def test_requeue_outside_a_scheduler_is_refused_when_the_accelerator_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHRIG_PREEMPTION__SIGNALS", "SIGUSR1")
    monkeypatch.setenv("TORCHRIG_PREEMPTION__REQUEUE", "true")
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    with pytest.raises(ConfigError) as excinfo:
        Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                  automatic_checkpoint_naming=True))
    assert "preemption.requeue" in str(excinfo.value) and "TORCHRIG_PREEMPTION__REQUEUE" in str(excinfo.value)


def test_under_slurm_the_requeue_command_is_scontrol_requeue_of_the_job(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHRIG_PREEMPTION__SIGNALS", "SIGUSR1")
    monkeypatch.setenv("TORCHRIG_PREEMPTION__REQUEUE", "true")
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                            automatic_checkpoint_naming=True))
    assert accelerator._requeue_command == ["scontrol", "requeue", "4711"]
    assert preemption.installed_signals() == ["SIGUSR1"]


def test_a_request_stops_at_the_next_step_boundary_after_an_optimizer_step(tmp_path, monkeypatch):
    """In process: the loop body of the step that saw the signal completes; the checkpoint holds
    the state after that optimizer step; the stop is a SystemExit with code 75."""
    monkeypatch.setenv("TORCHRIG_PREEMPTION__SIGNALS", "SIGUSR1")
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.arange(24.0).reshape(8, 3), batch_size=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    bodies = 0
    with pytest.raises(preemption.Preempted) as excinfo:
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(batch).sum())
                optimizer.step()
                optimizer.zero_grad()
            bodies += 1
            if bodies == 3:  # mid-accumulation: the stop waits for the next synchronising step
                preemption.request("SIGUSR1")
    stop = excinfo.value
    assert stop.code == 75 and stop.signal_name == "SIGUSR1"
    assert bodies == 4 and stop.step == 2  # micro-steps 3 and 4 form optimizer step 2
    assert stop.checkpoint == str(tmp_path / "checkpoints" / "checkpoint_0")
    assert _checkpoints(tmp_path) == ["checkpoint_0"]
    saved = load_file(str(Path(stop.checkpoint) / "model.safetensors"))
    assert all(torch.equal(saved[name], value) for name, value in model.state_dict().items())


def test_signals_named_in_the_environment_are_recorded_from_import_and_refused_names_left_to_the_config():
    assert preemption.install_from_environment({preemption.SIGNALS_ENV: "usr1, SIGKILL"}) == ["SIGUSR1"]
    assert preemption.installed_signals() == ["SIGUSR1"]  # SIGKILL: the configuration names the problem
    assert preemption.install_from_environment({preemption.SIGNALS_ENV: ""}) == []


def test_a_signal_the_resolved_configuration_leaves_out_gets_its_handler_back_and_a_request_is_raised_again():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        preemption.install_signal_handlers(["SIGUSR1"])
        preemption.request("SIGUSR1")  # recorded before the configuration turned preemption off
        preemption.keep_only([])
        assert preemption.installed_signals() == [] and preemption.requested() is None
        assert seen == [signal.SIGUSR1]  # not swallowed: the handler from before ran
    finally:
        signal.signal(signal.SIGUSR1, previous)


# ---------------------------------------------------------------- real processes


@pytest.mark.multiprocess
def test_one_process_stops_with_a_checkpoint_and_resumes_exactly(tmp_path, process_guard):
    straight = _run(tmp_path, process_guard, [sys.executable, *_train(tmp_path / "straight")])
    assert straight.returncode == 0, straight.stderr
    first = _run(tmp_path, process_guard, [sys.executable, *_train(tmp_path / "preempted", "--signal-self-at", "7")],
                 TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1")
    assert first.returncode == 75, first.stderr
    assert "preempted by SIGUSR1" in first.stderr and "after optimizer step 7" in first.stderr
    assert len(_log(tmp_path / "preempted", 0)) == 7 and not (tmp_path / "preempted" / "final.pt").exists()
    second = _run(tmp_path, process_guard, [sys.executable, *_train(tmp_path / "preempted")],
                  TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1")
    assert second.returncode == 0, second.stderr
    assert "resumed at step 7" in second.stdout
    _assert_same_training(tmp_path / "straight", tmp_path / "preempted", ranks=1)


@pytest.mark.multiprocess
def test_without_preemption_configured_the_signal_keeps_its_default_action(tmp_path, process_guard):
    """Opt-in: nothing catches SIGUSR1 unless asked (its default action ends the process)."""
    run = _run(tmp_path, process_guard, [sys.executable, *_train(tmp_path / "plain", "--signal-self-at", "3")])
    assert run.returncode == -signal.SIGUSR1
    assert _checkpoints(tmp_path / "plain") == []


def _wait_for_steps(project: Path, proc: subprocess.Popen, steps: int) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT
    while len(_log(project, 0)) < steps:
        assert proc.poll() is None, f"the launch ended before step {steps}"
        assert time.monotonic() < deadline, f"no step {steps} within {RUN_TIMEOUT} s"
        time.sleep(0.05)


@pytest.mark.multiprocess
@pytest.mark.parametrize("warning", ["SIGUSR1", "SIGTERM"])
def test_a_signal_to_the_launcher_checkpoints_every_rank_exits_75_without_restart_and_resumes(
        tmp_path, process_guard, warning):
    straight = _run(tmp_path, process_guard, _launch(*_train(tmp_path / "straight")))
    assert straight.returncode == 0, straight.stderr
    project, logs = tmp_path / "preempted", tmp_path / "logs"
    proc = subprocess.Popen(_launch("--max_restarts", "2", "--log_dir", str(logs), *_train(project, "--delay", "0.2")),
                            start_new_session=True, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=_env(tmp_path, TORCHRIG_PREEMPTION__SIGNALS=warning))
    process_guard.track(proc)
    _wait_for_steps(project, proc, 3)
    proc.send_signal(signal.Signals[warning])
    _, err = proc.communicate(timeout=RUN_TIMEOUT)
    assert proc.returncode == 75, err
    assert f"PREEMPTED: preempted by {warning}" in err and "restarts used: 0 of 2" in err
    report = json.loads((logs / RUN_STATUS_FILE).read_text())
    assert report["state"] == "preempted" and report["exit_code"] == 75
    ranks = report["attempts"][-1]["ranks"]
    assert [r["state"] for r in ranks] == ["preempted", "preempted"]
    stopped_at = {r["preempted"]["step"] for r in ranks}
    assert len(stopped_at) == 1 and stopped_at.pop() == len(_log(project, 0)) == len(_log(project, 1))
    assert _checkpoints(project) == ["checkpoint_0"]

    resumed = _run(tmp_path, process_guard, _launch(*_train(project)), TORCHRIG_PREEMPTION__SIGNALS=warning)
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_training(tmp_path / "straight", project, ranks=2)


@pytest.mark.multiprocess
def test_a_signal_to_one_rank_stops_every_rank_at_the_same_synchronising_step(tmp_path, process_guard):
    """Rank 1 alone is warned after micro-step 1, mid-accumulation (accumulation 2): at the
    synchronising boundary after micro-step 2 it puts its flag in the agreement round, which every
    rank reads at the next synchronising boundary — so both stop after micro-step 4 (optimizer
    step 2), never mid-accumulation nor at different steps."""
    project = tmp_path / "preempted"
    run = _run(tmp_path, process_guard, _launch(*_train(project, "--signal-self-at", "1", "--signal-rank", "1",
                                                        "--accumulate", "2")),
               TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1")
    assert run.returncode == 75, run.stderr
    steps = [len(_log(project, rank)) for rank in (0, 1)]
    assert steps == [4, 4]
    assert "preempted by SIGUSR1: checkpoint" in run.stderr  # said by rank 0, which was not warned itself
    assert "after optimizer step 2" in run.stderr

    straight = _run(tmp_path, process_guard, _launch(*_train(tmp_path / "straight", "--accumulate", "2")))
    assert straight.returncode == 0, straight.stderr
    resumed = _run(tmp_path, process_guard, _launch(*_train(project, "--accumulate", "2")),
                   TORCHRIG_PREEMPTION__SIGNALS="SIGUSR1")
    assert resumed.returncode == 0, resumed.stderr
    _assert_same_training(tmp_path / "straight", project, ranks=2)
