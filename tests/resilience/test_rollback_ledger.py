"""The training guard's rollback: a bad step records its batches in the skip ledger beside the
checkpoints and ends the ranks; the run resumed with load_state() never sees those batches and ends
with the weights of a run on the data without them; past max_rollbacks, with no checkpoint yet, or
without a project directory, it stops naming the step, the batch and why. One rank in this process
here; tests/resilience/test_rollback_launch.py runs it under ``torchrig launch``."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, Subset, TensorDataset
from torchrig import Accelerator
from torchrig.config.options import TrainingGuardConfig
from torchrig.data.loader import PreparedDataLoader
from torchrig.errors import ConfigError
from torchrig.resilience.rollback_ledger import LEDGER_FILE, read_ledger
from torchrig.resilience.training_guard import ROLLBACKS_METRIC, TrainingGuardRollback, TrainingGuardStop
from torchrig.utils import ProjectConfiguration

BATCHES, BATCH = 8, 4


def _data(poisoned=()) -> TensorDataset:
    """A dataset whose batches in ``poisoned`` hold a NaN input: their loss is NaN every time they are seen."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCHES * BATCH, 16, generator=generator)
    y = torch.randn(BATCHES * BATCH, 2, generator=generator)
    for batch in poisoned:
        x[batch * BATCH + 1, 3] = float("nan")
    return TensorDataset(x, y)


def _train(project, data, guard: TrainingGuardConfig | None, *, resume=False, save_every=3, accumulation=1):
    """Momentum SGD on a tiny MLP; a checkpoint after every ``save_every``-th batch of the epoch."""
    project_config = ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=True, log_with="jsonl", project_config=project_config,
                              gradient_accumulation_steps=accumulation,
                              kwargs_handlers=[guard] if guard is not None else [])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(data, batch_size=BATCH))
    accelerator.init_trackers("run")
    if resume:
        accelerator.load_state()
    try:
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            if loader.state_dict()["batches_yielded"] % save_every == 0:
                accelerator.save_state()
    finally:  # a rank the guard ends finishes its trackers at exit (atexit); here, before the test reads them
        accelerator.end_training()
    return model


def _logs(project):
    lines = (project / "run" / "metrics.jsonl").read_text().splitlines()
    return [(line["step"], line["values"]) for line in map(json.loads, lines) if line["event"] == "log"]


def test_a_rollback_resumes_without_the_bad_batch_and_ends_with_the_weights_of_a_run_without_it(tmp_path):
    guard = TrainingGuardConfig(enabled=True, on_nonfinite="rollback")
    project = tmp_path / "guarded"
    with pytest.raises(TrainingGuardRollback) as stopped:
        _train(project, _data(poisoned={5}), guard)
    assert stopped.value.code == 76
    assert "optimizer step 5" in str(stopped.value) and "dataloader 0 epoch 0 batch 5" in str(stopped.value)
    ledger = json.loads((project / "checkpoints" / LEDGER_FILE).read_text())
    assert ledger["rollbacks"] == 1
    assert [(entry["step"], entry["checkpoint"], entry["batches"]) for entry in ledger["entries"]] == [
        (5, "checkpoint_0", [{"dataloader": 0, "epoch": 0, "batch": 5}])]  # saved after batch 2 (3 yielded)
    assert _logs(project) == [(5, {ROLLBACKS_METRIC: 1})]

    resumed = _train(project, _data(poisoned={5}), guard, resume=True)
    reference = _train(tmp_path / "reference", Subset(_data(), [i for i in range(BATCHES * BATCH) if i // BATCH != 5]),
                       None)
    for (name, param), expected in zip(resumed.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(param, expected), name
    assert read_ledger(project / "checkpoints").rollbacks == 1


def test_with_accumulation_every_micro_batch_of_the_bad_step_is_skipped(tmp_path):
    guard = TrainingGuardConfig(enabled=True, on_nonfinite="rollback")
    project = tmp_path / "guarded"
    with pytest.raises(TrainingGuardRollback, match=r"optimizer step 2 .*batch 4, dataloader 0 epoch 0 batch 5;"):
        _train(project, _data(poisoned={5}), guard, accumulation=2, save_every=4)
    resumed = _train(project, _data(poisoned={5}), guard, accumulation=2, save_every=4, resume=True)
    kept = [i for i in range(BATCHES * BATCH) if i // BATCH not in (4, 5)]
    reference = _train(tmp_path / "reference", Subset(_data(), kept), None, accumulation=2, save_every=4)
    for (name, param), expected in zip(resumed.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(param, expected), name


def test_past_max_rollbacks_the_run_stops_naming_the_step_and_its_batch(tmp_path):
    guard = TrainingGuardConfig(enabled=True, on_spike="stop", on_nonfinite="rollback", max_rollbacks=1)
    with pytest.raises(TrainingGuardRollback):
        _train(tmp_path, _data(poisoned={4, 7}), guard)
    with pytest.raises(TrainingGuardStop, match=r"optimizer step 3 .*dataloader 0 epoch 0 batch 7; 1 rollbacks already "
                                                r"made from .*checkpoints \(max_rollbacks 1\): no rollback left"):
        _train(tmp_path, _data(poisoned={4, 7}), guard, resume=True)  # resumed after batch 2: steps 0-3 are 3, 5, 6, 7


def test_with_no_checkpoint_yet_the_run_stops_naming_why(tmp_path):
    guard = TrainingGuardConfig(enabled=True, on_nonfinite="rollback")
    with pytest.raises(TrainingGuardStop, match=r"optimizer step 1 .*dataloader 0 epoch 0 batch 1; cannot roll back: no "
                                                r"checkpoint has been committed yet"):
        _train(tmp_path, _data(poisoned={1}), guard)
    assert not (tmp_path / "checkpoints" / LEDGER_FILE).exists()


def test_without_a_project_directory_the_run_stops_naming_why():
    accelerator = Accelerator(cpu=True, kwargs_handlers=[TrainingGuardConfig(enabled=True, on_nonfinite="rollback")])
    model = nn.Linear(16, 2)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                   DataLoader(_data(poisoned={0}), batch_size=BATCH))
    batches = iter(loader)  # being iterated: its batch is the step's
    x, y = next(batches)
    accelerator.backward(F.mse_loss(model(x), y))
    with pytest.raises(TrainingGuardStop, match=r"batch 0; cannot roll back: automatic checkpoint naming needs a "
                                                r"project directory"):
        optimizer.step()


@pytest.mark.parametrize("key, value, message", [
    ("max_rollbacks", "-1", "training_guard.max_rollbacks (environment TORCHRIG_TRAINING_GUARD__MAX_ROLLBACKS): "
                            "must be at least 0"),
    ("rollback_exit_code", "0", "training_guard.rollback_exit_code (environment "
                                "TORCHRIG_TRAINING_GUARD__ROLLBACK_EXIT_CODE)"),
    ("on_spike", "rewind", "training_guard.on_spike (environment TORCHRIG_TRAINING_GUARD__ON_SPIKE): expected "
                           "'skip', 'stop' or 'rollback'; got 'rewind'"),
])
def test_bad_rollback_values_are_refused_naming_the_key_and_its_source(monkeypatch, key, value, message):
    monkeypatch.setenv(f"TORCHRIG_TRAINING_GUARD__{key.upper()}", value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        Accelerator(cpu=True)


def test_a_damaged_ledger_is_an_error_naming_the_file(tmp_path):
    (tmp_path / LEDGER_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"the skip ledger {tmp_path / LEDGER_FILE} cannot be read")):
        read_ledger(tmp_path)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(12.0))


@pytest.mark.parametrize("dataset", [TensorDataset(torch.arange(12.0)), _Stream()], ids=["map", "iterable"])
def test_a_prepared_loader_never_hands_out_a_skipped_position_the_last_of_an_epoch_included(dataset):
    loader = PreparedDataLoader(DataLoader(dataset, batch_size=3))
    loader.skip_batches([(0, 1), (1, 3)])
    epochs = [[(batch[0] if isinstance(batch, list) else batch).tolist() for batch in loader] for _ in range(2)]
    assert epochs == [[[0, 1, 2], [6, 7, 8], [9, 10, 11]], [[0, 1, 2], [3, 4, 5], [6, 7, 8]]]
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["batches_yielded"] == 0
