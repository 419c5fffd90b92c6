"""Experiment trackers, read back with the trackers' own libraries.

TensorBoard through its ``EventAccumulator``, MLflow through ``MlflowClient`` on the local store,
W&B through the records of its offline run file (parsed with W&B's own protobuf classes), csv and
jsonl by parsing. No library is mocked: the trackers run for real. Multi-process: the gloo worker
pool and one real ``torchrig launch`` of two ranks.
"""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrig import Accelerator, PluginImportError, Tracker
from torchrig.testing.contracts import TrackerContract, rank_environment
from torchrig.tracking import hub as tracking
from torchrig.tracking import lane as tracker_lane

SCRIPTS = Path(__file__).parent / "tracker_scripts"
STEPS = 12


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch, tmp_path):
    """No machine default file, TORCHRIG_* or tracker variable from the developer's machine;
    W&B offline, silent, and keeping its settings and caches in the test's directory."""
    for key in [k for k in os.environ if k.startswith(("TORCHRIG_", "WANDB_", "MLFLOW_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path / "torchrig-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))


def accelerator_for(tmp_path: Path, log_with, **kwargs) -> Accelerator:
    return Accelerator(cpu=True, log_with=log_with, project_dir=str(tmp_path / "project"), **kwargs)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------------------------
# custom trackers used by the tests


class Recorder(Tracker):
    """Remembers every call (and may wait at ``start`` until allowed to go on)."""

    name = "recorder"

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.gate = gate
        self.calls: list[tuple] = []

    def start(self) -> None:
        if self.gate is not None:
            self.gate.wait(30)

    def store_init_configuration(self, values):
        self.calls.append(("config", values))

    def log(self, values, step, **kwargs):
        self.calls.append(("log", values, step, kwargs))


class AlwaysRaises(Tracker):
    """Every call raises, like a tracker whose server is unreachable."""

    name = "always_raises"

    def store_init_configuration(self, values):
        raise ConnectionError("server unreachable")

    def log(self, values, step, **kwargs):
        raise ConnectionError("server unreachable")

    def finish(self):
        raise ConnectionError("server unreachable")


class CannotStart(Tracker):
    name = "cannot_start"

    def start(self):
        raise ConnectionError("no route to host")

    def log(self, values, step, **kwargs):
        raise AssertionError("log() must not be called when start() failed")


class Blocks(Tracker):
    """``log`` hangs until ``gate`` is set, like a call to a server that never answers."""

    name = "blocks"
    queue_size = 4
    wait_timeout = 0.2

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()

    def log(self, values, step, **kwargs):
        self.entered.set()
        self.gate.wait(60)


def train(accelerator: Accelerator, steps: int) -> tuple[torch.nn.Module, float]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    first = None
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        first = loss.item() if first is None else first
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.detach()}, step=step)
    return model, first - loss.item()


# --------------------------------------------------------------------------------------------
# csv / jsonl, the step model, hyperparameters


def test_csv_and_jsonl_record_steps_values_and_the_configuration_with_sources(tmp_path):
    accelerator = accelerator_for(tmp_path, ["csv", "jsonl"], gradient_accumulation_steps=2)
    accelerator.init_trackers("demo", config={"lr": 0.01, "model": {"width": 64}})
    accelerator.log({"loss": torch.tensor(0.5), "acc": 0.25, "note": "warmup"}, step=0)
    accelerator.log({"loss": 0.4})  # step None: the step after the last one -> 1
    accelerator.log({"loss": 0.3, "nested": {"a": 1}}, step=5)
    accelerator.log({"loss": 0.2})  # -> 6
    report = accelerator.end_training()

    assert set(report) == {"csv", "jsonl"}
    for row in report.values():
        assert (row["state"], row["delivered"], row["dropped"], row["errors"]) == ("finished", 5, 0, 0), row

    run_dir = tmp_path / "project" / "demo"
    with open(run_dir / "metrics.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["step"], r["name"], r["value"]) for r in rows] == [
        ("0", "loss", "0.5"), ("0", "acc", "0.25"), ("0", "note", "warmup"), ("1", "loss", "0.4"),
        ("5", "loss", "0.3"), ("5", "nested/a", "1"), ("6", "loss", "0.2")]
    with open(run_dir / "hparams.csv", newline="") as handle:
        hparams = {r["name"]: r["value"] for r in csv.DictReader(handle)}
    assert hparams["lr"] == "0.01" and hparams["model/width"] == "64"
    assert hparams["torchrig/gradient_accumulation_steps"] == "2"
    assert hparams["torchrig_sources/gradient_accumulation_steps"] == "argument Accelerator(gradient_accumulation_steps=...)"
    assert hparams["torchrig/log_with"] == '["csv", "jsonl"]'
    assert hparams["torchrig_run/num_processes"] == "1"

    events = read_jsonl(run_dir / "metrics.jsonl")
    assert [e["event"] for e in events] == ["start", "config", "log", "log", "log", "log", "finish"]
    config = events[1]["config"]
    assert config["lr"] == 0.01 and config["torchrig"]["use_cpu"] is True
    assert config["torchrig_sources"]["project_config"]["project_dir"] == "argument Accelerator(project_config=...)"
    # a compact summary: defaults nobody set are left out (tracker_hyperparameters: full keeps them)
    assert "fsdp_config" not in config["torchrig"] and "deepspeed_config" not in config["torchrig"]
    assert "dataloader_config" not in config["torchrig"] and config["torchrig"]["strategy"] == "single"
    assert [(e["step"], e["values"]) for e in events[2:6]] == [
        (0, {"loss": 0.5, "acc": 0.25, "note": "warmup"}), (1, {"loss": 0.4}),
        (5, {"loss": 0.3, "nested": {"a": 1}}), (6, {"loss": 0.2})]


def test_steps_must_be_non_negative_integers_on_every_rank(tmp_path):
    accelerator = accelerator_for(tmp_path, ["jsonl"])
    accelerator.init_trackers("demo")
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        accelerator.log({"loss": 1.0}, step=-1)
    with pytest.raises(TypeError, match="step must be an integer"):
        accelerator.log({"loss": 1.0}, step=1.5)
    with pytest.raises(TypeError, match="step must be an integer"):
        accelerator.log({"loss": 1.0}, step=True)
    with pytest.raises(ValueError, match=r"step must be <= 2\*\*63-1 \(the int64 the trackers store\), got 9223372036854775808"):
        accelerator.log({"loss": 1.0}, step=2**63)  # MLflow would fail the whole batch it travels in
    with pytest.raises(TypeError, match="expected a mapping"):
        accelerator.log([("loss", 1.0)])
    accelerator.log({"loss": 1.0}, step=np.int64(3))
    accelerator.log({"loss": 1.0}, step=torch.tensor(4))
    accelerator.end_training()
    steps = [e["step"] for e in read_jsonl(tmp_path / "project" / "demo" / "metrics.jsonl") if e["event"] == "log"]
    assert steps == [3, 4]


def test_values_are_snapshotted_when_logged(tmp_path):
    gate = threading.Event()
    recorder = Recorder(gate)  # cannot process anything before the loop changed the tensor
    accelerator = accelerator_for(tmp_path, [recorder])
    accelerator.init_trackers("demo")
    running = torch.zeros(())
    for step in range(3):
        running += 1.0  # in place, as a running total often is
        accelerator.log({"total": running}, step=step)
    gate.set()
    accelerator.end_training()
    logged = [(call[2], call[1]["total"].item()) for call in recorder.calls if call[0] == "log"]
    assert logged == [(0, 1.0), (1, 2.0), (2, 3.0)]


def test_init_kwargs_log_kwargs_and_misuse_give_errors_naming_the_tracker(tmp_path):
    recorder = Recorder()
    accelerator = accelerator_for(tmp_path, ["csv", recorder])
    with pytest.raises(ValueError, match=r"init_kwargs=...\) has entries for 'wandbb'.*trackers of this run: csv, recorder"):
        accelerator.init_trackers("demo", init_kwargs={"wandbb": {}})
    with pytest.raises(TypeError, match=r"tracker plugin 'tracker:csv'.*bogus.*check init_kwargs\['csv'\]"):
        accelerator.init_trackers("demo", init_kwargs={"csv": {"bogus": 1}})
    with pytest.raises(ValueError, match="'nope' is not a tracker of this run; its trackers: csv, recorder"):
        accelerator.get_tracker("nope")
    accelerator.init_trackers("demo", init_kwargs={"csv": {"filename": "custom.csv"}})
    with pytest.raises(RuntimeError, match="init_trackers\\(\\) was already called"):
        accelerator.init_trackers("demo")
    accelerator.log({"loss": 1.0}, step=0, log_kwargs={"recorder": {"commit": False}})
    assert accelerator.get_tracker("recorder").unwrapped is recorder
    assert accelerator.get_tracker("recorder", unwrap=True) is recorder  # Tracker.tracker defaults to itself
    accelerator.end_training()
    assert (tmp_path / "project" / "demo" / "custom.csv").is_file()
    assert [c[1:] for c in recorder.calls if c[0] == "log"] == [({"loss": 1.0}, 0, {"commit": False})]

    with pytest.raises(TypeError, match="does not implement log"):
        accelerator_for(tmp_path, [Tracker()]).init_trackers("demo")
    with pytest.raises(ValueError, match="several trackers named 'recorder'"):
        accelerator_for(tmp_path, [Recorder(), Recorder()]).init_trackers("demo")


def test_log_before_init_is_ignored_and_a_new_run_may_start_after_end_training(tmp_path):
    accelerator = accelerator_for(tmp_path, ["jsonl"])
    accelerator.log({"loss": 9.0}, step=0)  # no tracker runs yet: nothing to send to
    assert accelerator.trackers == [] and not accelerator.get_tracker("jsonl")
    assert accelerator.end_training() == {}
    accelerator.init_trackers("demo")
    accelerator.log({"loss": 1.0}, step=1)
    first = accelerator.end_training()
    assert first["jsonl"]["delivered"] == 2
    assert accelerator.end_training() == first  # finishing twice reports the same run
    accelerator.log({"loss": 2.0}, step=2)  # after end_training: not recorded, counted with its step
    late = accelerator.end_training()["jsonl"]
    assert (late["after_end"], late["dropped"], late["dropped_steps"]) == (1, 1, {"after_end": [[2, 2]]})
    accelerator.init_trackers("demo")
    accelerator.log({"loss": 3.0}, step=3)
    accelerator.end_training()
    events = read_jsonl(tmp_path / "project" / "demo" / "metrics.jsonl")
    assert [e["event"] for e in events] == ["start", "config", "log", "finish"] * 2  # appended: two runs
    assert [e["values"]["loss"] for e in events if e["event"] == "log"] == [1.0, 3.0]


@pytest.mark.multiprocess
def test_the_core_finishes_trackers_at_exit_when_end_training_is_not_called(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(SCRIPTS / "exit_without_end.py"), str(tmp_path / "project")],
                            capture_output=True, text=True, timeout=120, env=env, check=False)
    assert result.returncode == 0, result.stderr
    events = read_jsonl(tmp_path / "project" / "demo" / "metrics.jsonl")
    assert [e["event"] for e in events] == ["start", "config", "log", "log", "log", "finish"]


# --------------------------------------------------------------------------------------------
# never fatal


def test_a_tracker_that_raises_on_every_call_does_not_stop_training(tmp_path, caplog):
    raising = AlwaysRaises()
    accelerator = accelerator_for(tmp_path, ["jsonl", raising])
    accelerator.init_trackers("demo")
    with caplog.at_level(logging.WARNING, logger="torchrig.tracking"):
        _, improvement = train(accelerator, steps=50)
        report = accelerator.end_training()
    assert improvement > 0  # training went on
    assert report["always_raises"] == {
        "state": "finished", "delivered": 0, "dropped": 51, "failed": 51, "errors": 52, "queue_full": 0,
        "rejected_steps": 0, "abandoned": 0, "not_started": 0, "crashed": 0, "after_end": 0, "unsupported": 0,
        "skipped_values": 0, "truncated_values": 0, "dropped_steps": {"failed": [[0, 49]]},
        "last_error": "ConnectionError: server unreachable"}
    assert report["jsonl"]["delivered"] == 51 and report["jsonl"]["dropped"] == 0  # the others unaffected
    raised = [r for r in caplog.records if "raised" in r.getMessage()]
    assert 1 <= len(raised) <= tracking.WARNING_BURST + 1, [r.getMessage() for r in raised]  # rate limited
    summary = [r.getMessage() for r in caplog.records if "dropped 51" in r.getMessage()]
    assert summary == [("tracker 'always_raises' finished: delivered 0 events, dropped 51 (51 failed: steps 0-49); "
                        "last error: ConnectionError: server unreachable")]


def test_a_tracker_that_cannot_start_drops_its_events_and_the_others_run(tmp_path):
    accelerator = accelerator_for(tmp_path, ["csv", CannotStart()])
    accelerator.init_trackers("demo")
    train(accelerator, steps=5)
    assert not accelerator.get_tracker("cannot_start", unwrap=True)  # a stand-in: calls do nothing
    report = accelerator.end_training()
    assert report["cannot_start"]["state"] == "failed"
    assert (report["cannot_start"]["not_started"], report["cannot_start"]["errors"]) == (6, 1)
    assert report["cannot_start"]["last_error"] == "ConnectionError: no route to host"
    assert report["csv"]["delivered"] == 6


def test_a_blocked_tracker_neither_blocks_nor_stops_training(tmp_path):
    blocked = Blocks()
    accelerator = accelerator_for(tmp_path, ["jsonl", blocked])
    accelerator.init_trackers("demo")
    try:
        accelerator.log({"warmup": 1.0}, step=0)
        assert blocked.entered.wait(30), "the tracker never received the first event"
        _, improvement = train(accelerator, steps=99)
        # every log() returned while the tracker was stuck inside its first log call
        assert not blocked.gate.is_set()
        report = accelerator.end_training()
    finally:
        blocked.gate.set()
    assert improvement > 0
    row = report["blocks"]
    assert row["state"] == "abandoned"
    assert row["delivered"] == 1  # the configuration, before the first log blocked
    assert row["queue_full"] == 100 - 1 - Blocks.queue_size  # one in flight, four waiting, the rest refused
    assert row["abandoned"] == Blocks.queue_size + 1
    assert row["dropped"] == 100 and row["delivered"] + row["dropped"] == 101
    assert report["jsonl"] == {**report["jsonl"], "state": "finished", "delivered": 101, "dropped": 0}


def test_warnings_are_rate_limited_with_a_count_of_the_suppressed(caplog):
    now = [0.0]
    warn = tracker_lane._Warner("flaky", clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="torchrig.tracking"):
        for _ in range(10):
            warn("log() raised: TimeoutError")
        now[0] += tracking.WARNING_INTERVAL / 2
        warn("log() raised: TimeoutError")
        now[0] += tracking.WARNING_INTERVAL
        warn("log() raised: TimeoutError")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["tracker 'flaky': log() raised: TimeoutError"] * tracking.WARNING_BURST + [
        f"tracker 'flaky': log() raised: TimeoutError ({10 - tracking.WARNING_BURST + 1} similar warnings suppressed)"]


def test_a_missing_library_fails_with_the_pip_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec sees when wandb is not installed
    with pytest.raises(PluginImportError, match=r"tracker plugin 'wandb'.*missing dependency 'wandb'.*"
                                                r"pip install 'torchrig\[wandb\]'"):
        accelerator_for(tmp_path, ["wandb"])
    accelerator = accelerator_for(tmp_path, "all")  # every *installed* tracker: wandb is not
    assert "wandb" not in [info.name for info in accelerator._host.selected("tracker")]
    assert {"csv", "jsonl"} <= {info.name for info in accelerator._host.selected("tracker")}


@pytest.mark.multiprocess
def test_torchrig_plugins_lists_the_trackers():
    result = subprocess.run([sys.executable, "-m", "torchrig", "plugins", "--json", "--kind", "tracker"],
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)["plugins"]}
    assert set(rows) == {"csv", "jsonl", "tensorboard", "wandb", "mlflow"}
    for row in rows.values():
        assert (row["kind"], row["distribution"], row["status"]) == ("tracker", "torchrig-trackers", "available"), row


# --------------------------------------------------------------------------------------------
# the libraries, read back with their own readers


def test_tensorboard_run_is_read_back_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accelerator = accelerator_for(tmp_path, "tensorboard")
    accelerator.init_trackers("demo", config={"lr": 0.05, "layers": [1, 2]})
    for step in range(STEPS):
        accelerator.log({"loss": torch.tensor(1.0 / (step + 1)), "note": f"step {step}", "weights": torch.ones(10)},
                        step=step)
    accelerator.log({"loss": 7.0}, step=3)  # TensorBoard records any step order
    accelerator.get_tracker("tensorboard").log_images({"samples": np.zeros((2, 3, 8, 8), dtype=np.float32)}, step=4)
    assert type(accelerator.get_tracker("tensorboard", unwrap=True)).__name__ == "SummaryWriter"
    report = accelerator.end_training()
    assert report["tensorboard"]["delivered"] == STEPS + 3 and report["tensorboard"]["dropped"] == 0

    run_dir = tmp_path / "project" / "demo"
    assert len(glob.glob(str(tmp_path / "project" / "**" / "events.out.tfevents.*"), recursive=True)) == 1
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    loss = [(e.step, round(e.value, 6)) for e in events.Scalars("loss")]
    assert loss == [(s, round(1.0 / (s + 1), 6)) for s in range(STEPS)] + [(3, 7.0)]
    tags = events.Tags()
    assert "weights" in tags["histograms"] and "samples" in tags["images"]
    assert {"note", "hyperparameters"} <= {t.rsplit("/", 1)[0] for t in tags["tensors"]}
    hparams = events.PluginTagToContent("hparams")
    assert hparams, "no HParams summary"
    from tensorboard.plugins.hparams import plugin_data_pb2

    data = plugin_data_pb2.HParamsPluginData.FromString(hparams["_hparams_/session_start_info"])
    recorded = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in data.session_start_info.hparams.items()}
    assert recorded["lr"] == 0.05 and recorded["layers"] == "[1, 2]" and recorded["torchrig/strategy"] == "single"
    assert recorded["torchrig_sources/use_cpu"] == "argument Accelerator(use_cpu=...)"


def test_mlflow_run_is_read_back_by_the_mlflow_client(tmp_path):
    from mlflow.tracking import MlflowClient

    accelerator = accelerator_for(tmp_path, "mlflow")
    accelerator.init_trackers("demo", config={"lr": 0.05}, init_kwargs={"mlflow": {"run_name": "first", "tags": {"team": "a"}}})
    for step in range(STEPS):
        accelerator.log({"loss": torch.tensor(1.0 / (step + 1)), "note": "skipped: not a number"}, step=step)
    accelerator.log({"loss": 7.0}, step=3)  # MLflow records any step order
    handle = accelerator.get_tracker("mlflow")
    handle.log_table("predictions", columns=["x", "y"], data=[[1, 2], [3, 4]], step=5)
    run = accelerator.get_tracker("mlflow", unwrap=True)
    report = accelerator.end_training()
    assert report["mlflow"]["delivered"] == STEPS + 3 and report["mlflow"]["dropped"] == 0, report

    client = MlflowClient(tracking_uri="sqlite:///" + str(tmp_path / "project" / "mlflow.db"))
    experiment = client.get_experiment_by_name("demo")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == run.info.run_id
    recorded = runs[0]
    assert recorded.info.status == "FINISHED" and recorded.info.run_name == "first"
    assert recorded.data.tags["team"] == "a"
    history = sorted((m.step, round(m.value, 6)) for m in client.get_metric_history(recorded.info.run_id, "loss"))
    assert history == sorted([(s, round(1.0 / (s + 1), 6)) for s in range(STEPS)] + [(3, 7.0)])
    assert "note" not in recorded.data.metrics
    params = recorded.data.params
    assert params["lr"] == "0.05" and params["torchrig/strategy"] == "single" and params["torchrig/use_cpu"] == "True"
    assert params["torchrig_sources/use_cpu"] == "argument Accelerator(use_cpu=...)"
    artifacts = [a.path for a in client.list_artifacts(recorded.info.run_id)]
    assert "predictions.json" in artifacts
    assert str(tmp_path / "project" / "mlartifacts") in recorded.info.artifact_uri


def wandb_records(path: str):
    """The records of a W&B run file (LevelDB log framing, W&B's own protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:
            position += left
            continue
        if position + 7 + length > len(data):
            return  # the writer is still writing this chunk: read again later
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 2):  # full, first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk if kind == 4 else chunk)
            yield record


def read_wandb_run(run_dir: str) -> tuple[dict, list[tuple[int, dict]]]:
    """Config and history of a finished offline run. W&B's service process writes the file:
    ``run.finish()`` may return before it flushed, so wait for the run's ``exit`` record."""
    files = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    assert len(files) == 1, files
    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(files[0])):
        assert time.monotonic() < deadline, "W&B never wrote the run's exit record"
        time.sleep(0.1)
    config, history = {}, []
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.append((record.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
    return config, history


@pytest.mark.multiprocess
def test_wandb_offline_run_is_one_run_with_config_and_history(tmp_path):
    accelerator = accelerator_for(tmp_path, "wandb")
    accelerator.init_trackers("demo", config={"lr": 0.05}, init_kwargs={"wandb": {"name": "first"}})
    for step in range(STEPS):
        accelerator.log({"loss": torch.tensor(1.0 / (step + 1))}, step=step)
    accelerator.log({"loss": 7.0}, step=3)  # W&B would ignore it: refused and counted
    accelerator.get_tracker("wandb").log_table("predictions", columns=["x", "y"], data=[[1, 2]], step=STEPS)
    run = accelerator.get_tracker("wandb", unwrap=True)
    report = accelerator.end_training()
    assert report["wandb"]["rejected_steps"] == 1 and report["wandb"]["dropped"] == 1
    assert report["wandb"]["delivered"] == STEPS + 2 and report["wandb"]["errors"] == 0, report

    runs = glob.glob(str(tmp_path / "project" / "wandb" / "offline-run-*"))
    assert len(runs) == 1 and runs[0].endswith(f"-{run.id}")
    config, history = read_wandb_run(runs[0])
    assert config["lr"] == 0.05 and config["torchrig"]["strategy"] == "single"
    assert config["torchrig_sources"]["use_cpu"] == "argument Accelerator(use_cpu=...)"
    losses = [(step, round(items["loss"], 6)) for step, items in history if "loss" in items]
    assert losses == [(s, round(1.0 / (s + 1), 6)) for s in range(STEPS)]
    table = {key: value for step, items in history if step == STEPS for key, value in items.items()}
    assert (table.get("predictions/_type"), table.get("predictions/nrows")) == ("table-file", 1), table


# --------------------------------------------------------------------------------------------
# once per run: two processes


class EveryRank(Tracker):
    """A user's tracker that asks to run on every rank; writes one file per rank."""

    name = "every_rank"
    main_process_only = False

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def log(self, values, step, **kwargs):
        rank = os.environ.get("RANK", "0")
        with open(os.path.join(self.directory, f"every-{rank}.txt"), "a") as handle:
            handle.write(f"{step}\n")


def _two_ranks(ctx, project_dir):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, log_with=["jsonl", Recorder(), EveryRank(project_dir)], project_dir=project_dir)
        accelerator.init_trackers("demo", config={"lr": 0.1})
        for step in range(3):
            accelerator.log({"rank_loss": float(ctx.rank)}, step=step)
        names = [t.name for t in accelerator.trackers]
        elsewhere = accelerator.get_tracker("jsonl")
        unwrapped = accelerator.get_tracker("recorder", unwrap=True)
        try:
            accelerator.get_tracker("nope")
            unknown = None
        except ValueError as exc:
            unknown = str(exc)
        report = accelerator.end_training()
        accelerator.wait_for_everyone()
        return {"names": names, "jsonl_here": bool(elsewhere), "recorder": type(unwrapped).__name__,
                "unknown": unknown, "report": {k: v["delivered"] for k, v in report.items()}}


@pytest.mark.multiprocess
def test_two_processes_make_one_run_per_tracker_on_the_main_process(gloo_pool, tmp_path):
    rank0, rank1 = gloo_pool.run(_two_ranks, str(tmp_path), timeout=120)
    assert rank0["names"] == ["jsonl", "recorder", "every_rank"]
    assert rank1["names"] == ["every_rank"]  # only the tracker that asked for every rank
    assert (rank0["jsonl_here"], rank1["jsonl_here"]) == (True, False)  # rank 1: a stand-in
    assert (rank0["recorder"], rank1["recorder"]) == ("Recorder", "BlankTracker")
    assert rank0["unknown"] == rank1["unknown"] and "'nope' is not a tracker of this run" in rank0["unknown"]
    assert rank0["report"] == {"jsonl": 4, "recorder": 4, "every_rank": 4} and rank1["report"] == {"every_rank": 4}
    events = read_jsonl(tmp_path / "demo" / "metrics.jsonl")
    assert [e["event"] for e in events].count("start") == 1
    assert [e["values"]["rank_loss"] for e in events if e["event"] == "log"] == [0.0, 0.0, 0.0]
    assert (tmp_path / "every-0.txt").read_text() == (tmp_path / "every-1.txt").read_text() == "0\n1\n2\n"


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_torchrig_launch_two_processes_one_run_per_tracker_and_drops_in_run_status(tmp_path, process_guard):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    project, logs = tmp_path / "project", tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrig", "launch", "--num_processes", "2", "--cpu", "--log_dir", str(logs),
         str(SCRIPTS / "train_tracked.py"), str(project), str(STEPS)],
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    process_guard.track(proc)
    out, err = proc.communicate(timeout=360)
    assert proc.returncode == 0, out[-4000:] + err[-4000:]

    results = [json.loads((project / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert sorted(results[0]["trackers"]) == ["always_fails", "csv", "jsonl", "mlflow", "tensorboard", "wandb"]
    assert results[1]["trackers"] == [] and results[1]["report"] == {}
    report = results[0]["report"]
    for name in ("csv", "jsonl", "mlflow", "tensorboard", "wandb"):
        assert (report[name]["delivered"], report[name]["dropped"]) == (STEPS + 1, 0), (name, report[name])
    assert report["always_fails"]["dropped"] == STEPS + 1 and report["always_fails"]["delivered"] == 0

    # exactly one run per tracker, with the loss curve every tracker's reader sees
    expected_steps = list(range(STEPS))
    event_files = glob.glob(str(project / "**" / "events.out.tfevents.*"), recursive=True)
    assert len(event_files) == 1, event_files
    events = EventAccumulator(os.path.dirname(event_files[0]), size_guidance={"scalars": 0})
    events.Reload()
    tb_loss = [e.value for e in events.Scalars("loss")]
    assert [e.step for e in events.Scalars("loss")] == expected_steps

    client = MlflowClient(tracking_uri="sqlite:///" + str(project / "mlflow.db"))
    runs = client.search_runs([client.get_experiment_by_name("demo").experiment_id])
    assert len(runs) == 1
    history = sorted(client.get_metric_history(runs[0].info.run_id, "loss"), key=lambda m: m.step)
    assert [m.step for m in history] == expected_steps
    assert [round(m.value, 5) for m in history] == [round(v, 5) for v in tb_loss]
    params = runs[0].data.params
    assert params["torchrig/strategy"] == "ddp" and params["torchrig_run/num_processes"] == "2"
    assert params["torchrig_sources/num_processes"] == "flag --num_processes"

    wandb_runs = glob.glob(str(project / "wandb" / "offline-run-*"))
    assert len(wandb_runs) == 1, wandb_runs
    config, wb_history = read_wandb_run(wandb_runs[0])
    assert [s for s, items in wb_history if "loss" in items] == expected_steps and config["steps"] == STEPS

    events_jsonl = read_jsonl(project / "demo" / "metrics.jsonl")
    assert [e["event"] for e in events_jsonl].count("start") == 1
    with open(project / "demo" / "metrics.csv", newline="") as handle:
        assert [int(r["step"]) for r in csv.DictReader(handle) if r["name"] == "loss"] == expected_steps

    # the failing tracker's drops: in rank 0's status file and, as a warning, in run_status.json
    rank0 = json.loads((logs / "rank-0.status.json").read_text())
    assert rank0["trackers"]["always_fails"]["dropped"] == STEPS + 1
    run_status = json.loads((logs / "run_status.json").read_text())
    assert run_status["state"] == "finished"
    assert any(w.startswith("tracker 'always_fails' finished: delivered 0 events, dropped") for w in run_status["warnings"])


# --------------------------------------------------------------------------------------------
# the tracker contract (torchrig.testing.contracts.TrackerContract), read back by each library



class TestCSVContract(TrackerContract):
    tracker = "csv"

    def read_back(self, logging_dir, project):
        with open(logging_dir / project / "metrics.csv", newline="") as handle:
            return [(int(row["step"]), float(row["value"])) for row in csv.DictReader(handle) if row["name"] == "loss"]


class TestJSONLContract(TrackerContract):
    tracker = "jsonl"

    def read_back(self, logging_dir, project):
        return [(e["step"], e["values"]["loss"]) for e in read_jsonl(logging_dir / project / "metrics.jsonl")
                if e["event"] == "log"]


class TestTensorBoardContract(TrackerContract):
    tracker = "tensorboard"

    def read_back(self, logging_dir, project):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(logging_dir / project), size_guidance={"scalars": 0})
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars("loss")]


class TestMLflowContract(TrackerContract):
    tracker = "mlflow"

    def read_back(self, logging_dir, project):
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri="sqlite:///" + str(logging_dir / "mlflow.db"))
        (run,) = client.search_runs([client.get_experiment_by_name(project).experiment_id])
        return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss"))


@pytest.mark.multiprocess  # wandb starts its service process
class TestWandBContract(TrackerContract):
    """Offline: the run is read back from W&B's own run file."""

    tracker = "wandb"
    environment = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": "{tmp}/wandb-config",
                   "WANDB_CACHE_DIR": "{tmp}/wandb-cache", "WANDB_DATA_DIR": "{tmp}/wandb-data"}

    def read_back(self, logging_dir, project):
        (run_dir,) = glob.glob(str(logging_dir / "wandb" / "offline-run-*"))
        _, history = read_wandb_run(run_dir)
        return [(step, items["loss"]) for step, items in history if "loss" in items]
