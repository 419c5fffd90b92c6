"""Delivery: a tracker that cannot keep up loses nothing, and what is lost anyway is said.

Slow backends are the real libraries slowed down — an MLflow tracker whose ``MlflowClient``
sleeps before every call, writing to MLflow's own SQLite store and read back with
``MlflowClient``; a jsonl tracker that sleeps per event, read back from its file. A stuck
tracker blocks for real on an event; the rank status file is a real file read back.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torchrig import Accelerator, ConfigError, Tracker
from torchrig.plugin.tracker import flatten
from torchrig.resilience import run_status
from torchrig_trackers.files import CSVTracker, JSONLTracker
from torchrig_trackers.mlflow_tracker import MLflowTracker
from torchrig_trackers.tensorboard_tracker import TensorBoardTracker

STEPS = 25


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    """No machine default file and no TORCHRIG_*/MLFLOW_* variable from the developer's machine."""
    for key in [k for k in os.environ if k.startswith(("TORCHRIG_", "MLFLOW_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path / "torchrig-home"))


@pytest.fixture
def status_file(tmp_path):
    """This process's rank status file, as the launcher's worker wrapper sets it up."""
    path = tmp_path / "logs" / "rank-0.status.json"
    run_status._set_current(run_status.RankStatus(path))
    yield path
    run_status._set_current(None)


def accelerator_for(tmp_path: Path, log_with, **kwargs) -> Accelerator:
    return Accelerator(cpu=True, log_with=log_with, project_dir=str(tmp_path / "project"), **kwargs)


class SlowClient:
    """An ``MlflowClient`` whose every call first waits ``delay`` seconds, like a loaded
    tracking server; ``calls`` lists the methods called, in order."""

    def __init__(self, client, delay: float) -> None:
        self._client = client
        self._delay = delay
        self.calls: list[str] = []

    def __getattr__(self, name):
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        def slowed(*args, **kwargs):
            time.sleep(self._delay)
            self.calls.append(name)
            return attribute(*args, **kwargs)

        return slowed


class SlowMLflow(MLflowTracker):
    """The real MLflow tracker on a slow server, with a wait far shorter than its backlog."""

    name = "slow_mlflow"
    wait_timeout = 2.0

    def __init__(self, *args, delay: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay

    def start(self) -> None:
        super().start()
        self.client = SlowClient(self.client, self.delay)


class SlowJSONL(JSONLTracker):
    """The jsonl tracker taking ``delay`` seconds per event (and per call: it cannot batch)."""

    name = "slow_jsonl"
    wait_timeout = 0.5

    def __init__(self, *args, delay: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay

    def log(self, values, step, **kwargs):
        time.sleep(self.delay)
        super().log(values, step, **kwargs)


class SlowTensorBoard(TensorBoardTracker):
    """The TensorBoard tracker taking ``delay`` seconds per event."""

    name = "slow_tensorboard"
    wait_timeout = 0.5

    def __init__(self, *args, delay: float, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay = delay

    def log(self, values, step, **kwargs):
        time.sleep(self.delay)
        super().log(values, step, **kwargs)


class StuckAt(Tracker):
    """Records steps until ``stuck_step``, where its ``log`` blocks like a server that never answers."""

    name = "stuck"
    wait_timeout = 0.5

    def __init__(self, stuck_step: int) -> None:
        self.stuck_step = stuck_step
        self.gate = threading.Event()
        self.steps: list[int] = []

    def log(self, values, step, **kwargs):
        if step == self.stuck_step:
            self.gate.wait(120)
        self.steps.append(step)


class Recorder(Tracker):
    name = "recorder"

    def __init__(self) -> None:
        self.configs: list[dict] = []

    def store_init_configuration(self, values):
        self.configs.append(values)

    def log(self, values, step, **kwargs):
        pass


def mlflow_run(project: Path, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri="sqlite:///" + str(project / "mlflow.db"))
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


# --------------------------------------------------------------------------------------------
# slow is not stuck: every event arrives


def test_a_slow_mlflow_server_receives_every_event_batched(tmp_path, mlflow_store):
    from mlflow.tracking import MlflowClient

    project = tmp_path / "project"  # the store exists (its schema created), as a tracking server's does
    MlflowClient(tracking_uri="sqlite:///" + str(project / "mlflow.db")).create_experiment("demo")
    slow = SlowMLflow("demo", str(project), delay=0.3)
    accelerator = accelerator_for(tmp_path, [slow])
    accelerator.init_trackers("demo", config={"lr": 0.05})
    for step in range(STEPS):  # queued at once: the backlog takes far longer than wait_timeout per call
        accelerator.log({"loss": torch.tensor(1.0 / (step + 1)), "step_twice": 2 * step}, step=step)
    report = accelerator.end_training()["slow_mlflow"]
    assert (report["state"], report["delivered"], report["dropped"]) == ("finished", STEPS + 1, 0), report

    client, run = mlflow_run(project, "demo")
    history = sorted((m.step, round(m.value, 6)) for m in client.get_metric_history(run.info.run_id, "loss"))
    assert history == [(s, round(1.0 / (s + 1), 6)) for s in range(STEPS)]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "step_twice")) == list(range(STEPS))
    # one log_batch per batch of events, not one call per event
    assert slow.client.calls.count("log_batch") <= 6, slow.client.calls


def test_a_slow_tracker_that_cannot_batch_is_waited_for_while_it_makes_progress(tmp_path):
    project = tmp_path / "project"
    accelerator = accelerator_for(tmp_path, [SlowJSONL("demo", str(project), delay=0.1)])
    accelerator.init_trackers("demo")
    for step in range(20):  # 2 s of work behind a 0.5 s wait_timeout: each event comes in 0.1 s
        accelerator.log({"loss": float(step)}, step=step)
    report = accelerator.end_training()["slow_jsonl"]
    assert (report["state"], report["dropped"]) == ("finished", 0), report
    lines = [json.loads(line) for line in (project / "demo" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines if e["event"] == "log"] == list(range(20))


def test_a_slow_tensorboard_writer_records_every_event_read_back_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    project = tmp_path / "project"
    accelerator = accelerator_for(tmp_path, [SlowTensorBoard("demo", str(project), delay=0.1)])
    accelerator.init_trackers("demo")
    for step in range(STEPS):
        accelerator.log({"loss": torch.tensor(1.0 / (step + 1))}, step=step)
    report = accelerator.end_training()["slow_tensorboard"]
    assert (report["state"], report["delivered"], report["dropped"]) == ("finished", STEPS + 1, 0), report
    events = EventAccumulator(str(project / "demo"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("loss")] == [
        (s, round(1.0 / (s + 1), 6)) for s in range(STEPS)]


class SlowToStart(Tracker):
    """A tracker whose ``start`` waits for ``gate``, like an MLflow store creating its schema."""

    name = "slow_to_start"

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.steps: list[int] = []

    def start(self):
        self.gate.wait(120)

    def log(self, values, step, **kwargs):
        self.steps.append(step)


def test_a_tracker_slow_to_start_misses_none_of_the_first_thousands_of_steps(tmp_path):
    slow = SlowToStart()
    accelerator = accelerator_for(tmp_path, [slow])
    accelerator.init_trackers("demo")
    try:
        for step in range(5000):  # a fast loop logging every step while the tracker connects
            accelerator.log({"loss": 1.0}, step=step)
    finally:
        slow.gate.set()
    report = accelerator.end_training()["slow_to_start"]
    assert (report["delivered"], report["dropped"]) == (5001, 0), report
    assert slow.steps == list(range(5000))


# --------------------------------------------------------------------------------------------
# stuck: cut off after its deadline, the loss counted with its steps and said


def test_a_stuck_tracker_is_cut_off_with_its_dropped_steps_counted_and_named(tmp_path, status_file, caplog):
    stuck = StuckAt(stuck_step=5)
    accelerator = accelerator_for(tmp_path, ["jsonl", stuck])
    accelerator.init_trackers("demo")
    try:
        for step in range(10):
            accelerator.log({"loss": float(step)}, step=step)
        with caplog.at_level(logging.WARNING, logger="torchrig.tracking"):
            report = accelerator.end_training()
        assert not stuck.gate.is_set()  # end_training returned while the call was still stuck
    finally:
        stuck.gate.set()
    row = report["stuck"]
    assert row["state"] == "abandoned"
    assert (row["delivered"], row["abandoned"], row["dropped"]) == (6, 5, 5), row  # config + steps 0-4
    assert row["dropped_steps"] == {"abandoned": [[5, 9]]}
    assert (report["jsonl"]["dropped"], report["jsonl"]["dropped_steps"]) == (0, {})
    said = [r.getMessage() for r in caplog.records if "'stuck'" in r.getMessage()]
    assert any("5 abandoned" in m and "steps 5-9" in m for m in said), said

    recorded = json.loads(status_file.read_text())
    assert recorded["trackers"]["stuck"]["dropped_steps"] == {"abandoned": [[5, 9]]}
    assert any(w.startswith("tracker 'stuck' abandoned") and "steps 5-9" in w for w in recorded["warnings"])


def test_steps_of_queue_full_drops_are_reported_as_ranges(tmp_path):
    class Tiny(StuckAt):
        name = "tiny"
        queue_size = 2

    tiny = Tiny(stuck_step=0)
    accelerator = accelerator_for(tmp_path, [tiny])
    accelerator.init_trackers("demo")
    try:
        deadline = time.monotonic() + 30
        accelerator.log({"x": 0.0}, step=0)
        while tiny.gate.is_set() or not accelerator.trackers[0]._lane.busy_with == "log":
            assert time.monotonic() < deadline, "the tracker never took step 0"
            time.sleep(0.01)
        for step in (1, 2, 3, 4, 7, 8):  # 1 and 2 wait in the queue; the rest do not fit
            accelerator.log({"x": float(step)}, step=step)
        report = accelerator.end_training()["tiny"]
    finally:
        tiny.gate.set()
    assert report["queue_full"] == 4 and report["dropped_steps"]["queue_full"] == [[3, 4], [7, 8]]
    assert report["dropped_steps"]["abandoned"] == [[0, 2]]


# --------------------------------------------------------------------------------------------
# what is logged as hyperparameters


def test_hyperparameters_are_the_users_config_plus_a_compact_summary_by_default(tmp_path, mlflow_store):
    recorder = Recorder()
    accelerator = accelerator_for(tmp_path, ["mlflow", recorder], gradient_accumulation_steps=2)
    accelerator.init_trackers("demo", config={"lr": 0.05, "model": {"layers": 4}})
    accelerator.end_training()
    (values,) = recorder.configs
    flat = flatten(values)
    assert flat["lr"] == 0.05 and flat["model/layers"] == 4
    assert flat["torchrig/strategy"] == "single" and flat["torchrig/mixed_precision"] == "no"
    assert flat["torchrig/gradient_accumulation_steps"] == 2 and flat["torchrig/use_cpu"] is True
    assert flat["torchrig_sources/gradient_accumulation_steps"] == "argument Accelerator(gradient_accumulation_steps=...)"
    assert flat["torchrig_run/num_processes"] == 1
    assert "torchrig/profile_kwargs/with_stack" not in flat  # a default nobody set: not a hyperparameter
    assert len(flat) < 20, sorted(flat)

    _, run = mlflow_run(tmp_path / "project", "demo")
    assert set(run.data.params) == set(flat)


def test_the_full_configuration_is_logged_when_asked_for(tmp_path, monkeypatch, mlflow_store):
    monkeypatch.setenv("TORCHRIG_TRACKER_HYPERPARAMETERS", "full")
    recorder = Recorder()
    accelerator = accelerator_for(tmp_path, ["mlflow", recorder])
    accelerator.init_trackers("demo", config={"lr": 0.05})
    report = accelerator.end_training()
    assert report["mlflow"]["dropped"] == 0, report
    flat = flatten(recorder.configs[0])
    assert flat["torchrig/profile_kwargs/with_stack"] is False and len(flat) > 100
    _, run = mlflow_run(tmp_path / "project", "demo")
    assert set(run.data.params) == set(flat)  # every key, in batches of MLflow's per-call limit


def test_a_bad_tracker_hyperparameters_value_names_the_key_and_the_choices(tmp_path):
    (tmp_path / "run.yaml").write_text("tracker_hyperparameters: everything\n")
    with pytest.raises(ConfigError, match=r"tracker_hyperparameters \(.*run.yaml:1:1\): must be one of summary, full, got 'everything'"):
        accelerator_for(tmp_path, ["jsonl"], config_file=str(tmp_path / "run.yaml"))


# --------------------------------------------------------------------------------------------
# other silent losses


def test_events_logged_after_end_training_are_counted_and_said_once(tmp_path, caplog):
    accelerator = accelerator_for(tmp_path, ["jsonl"])
    accelerator.init_trackers("demo")
    accelerator.log({"loss": 1.0}, step=0)
    accelerator.end_training()
    with caplog.at_level(logging.WARNING, logger="torchrig.tracking"):
        for step in (1, 2, 3):
            accelerator.log({"loss": 2.0}, step=step)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "after end_training" in said[0] and "'jsonl'" in said[0], said
    row = accelerator.end_training()["jsonl"]
    assert (row["after_end"], row["dropped"], row["dropped_steps"]) == (3, 3, {"after_end": [[1, 3]]})


def test_values_a_tracker_cannot_record_are_counted_and_said_once(tmp_path, caplog, mlflow_store):
    project = tmp_path / "project"
    accelerator = accelerator_for(tmp_path, [MLflowTracker("demo", str(project)), CSVTracker("demo", str(project))])
    accelerator.init_trackers("demo")
    with caplog.at_level(logging.WARNING, logger="torchrig.tracking"):
        for step in range(4):
            accelerator.log({"loss": float(step), "note": "text", "weights": torch.ones(3)}, step=step)
        report = accelerator.end_training()
    assert report["mlflow"]["skipped_values"] == 8 and report["csv"]["skipped_values"] == 4, report
    said = [r.getMessage() for r in caplog.records if "is not recorded" in r.getMessage()]
    assert sorted(said) == sorted([
        "tracker 'mlflow': value 'note' (str) is not recorded: MLflow metrics are numbers (said once per name)",
        "tracker 'mlflow': value 'weights' (Tensor) is not recorded: MLflow metrics are numbers (said once per name)",
        "tracker 'csv': value 'weights' (Tensor) is not recorded: csv rows hold numbers and strings (said once per name)",
    ]), said
    assert any("'mlflow'" in r.getMessage() and "8 values not recorded" in r.getMessage() for r in caplog.records)


def test_mlflow_names_that_collide_once_sanitised_are_all_kept(tmp_path, mlflow_store):
    project = tmp_path / "project"
    accelerator = accelerator_for(tmp_path, [MLflowTracker("demo", str(project))])
    accelerator.init_trackers("demo", config={"a@b": 1, "a#b": 2, "long": "x" * 7000})
    accelerator.log({"m@1": 1.0, "m#1": 2.0}, step=0)
    report = accelerator.end_training()["mlflow"]
    assert report["dropped"] == 0, report
    client, run = mlflow_run(project, "demo")
    params = run.data.params
    assert {params["a_b"], params["a_b_2"]} == {"1", "2"}  # neither lost, neither failing the batch
    assert len(params["long"]) == 6000 and report["truncated_values"] == 1
    assert {m.value for m in client.get_metric_history(run.info.run_id, "m_1")} | {
        m.value for m in client.get_metric_history(run.info.run_id, "m_1_2")} == {1.0, 2.0}
