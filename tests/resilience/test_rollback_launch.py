"""The training guard's rollback under ``torchrig launch`` on 2 gloo ranks: a poisoned batch (a NaN in
rank 1's part of global batch 5, seen every time it is read) ends attempt 0 with a rollback; the
launcher restarts the ranks without spending ``--max_restarts`` (0 here); the restarted script resumes
with ``load_state()``, skips the batch, finishes, and its weights equal — bit for bit — a model trained
in the same job on the data without that batch. One launch for every assertion."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torchrig.resilience.rollback_ledger import LEDGER_FILE
from torchrig.resilience.training_guard import ROLLBACKS_METRIC

SCRIPT = '''
import sys
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset
from torchrig import Accelerator
from torchrig.config.options import TrainingGuardConfig
from torchrig.utils import ProjectConfiguration

POISONED = 5  # global batch 5: samples 40..47, rank 0 reads 40..43, rank 1 44..47


def data(poisoned):
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 16, generator=generator), torch.randn(64, 2, generator=generator)
    if poisoned:
        x[POISONED * 8 + 5, 3] = float("nan")
    return TensorDataset(x, y)


project = sys.argv[1]
accelerator = Accelerator(cpu=True, log_with="jsonl", kwargs_handlers=[
    TrainingGuardConfig(enabled=True, on_nonfinite="rollback")], project_config=ProjectConfiguration(
    project_dir=project, automatic_checkpoint_naming=True, total_limit=2))
accelerator.init_trackers("run")


def train(dataset, guarded):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, DataLoader(dataset, batch_size=4))
    if guarded and accelerator.latest_checkpoint():
        accelerator.load_state()
    for x, y in loader:
        accelerator.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if guarded and loader.state_dict()["batches_yielded"] % 3 == 0:  # after global batches 2 and 5
            accelerator.save_state()
    return {name: value.clone() for name, value in accelerator.unwrap_model(model).state_dict().items()}


guarded = train(data(poisoned=True), guarded=True)
reference = train(Subset(data(poisoned=False), [i for i in range(64) if i // 8 != POISONED]), guarded=False)
if accelerator.is_main_process:
    torch.save({"guarded": guarded, "reference": reference}, project + "/weights.pt")
accelerator.end_training()
'''


@pytest.mark.timeout(240)
def test_a_poisoned_batch_rolls_back_is_skipped_on_restart_and_the_weights_equal_a_run_without_it(tmp_path,
                                                                                                 process_guard):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    project, logs = tmp_path / "project", tmp_path / "logs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "2",
                             "--log_dir", str(logs), str(script), str(project)], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    process_guard.track(proc)
    out, _ = proc.communicate(timeout=200)
    assert proc.returncode == 0, out
    assert "attempt 0 rolled back: bad step 5 on dataloader 0 epoch 0 batch 5" in out, out

    weights = torch.load(project / "weights.pt")
    for name, value in weights["guarded"].items():
        assert torch.equal(value, weights["reference"][name]), name

    ledger = json.loads((project / "checkpoints" / LEDGER_FILE).read_text())
    assert ledger["rollbacks"] == 1
    assert [(e["step"], e["checkpoint"], e["batches"]) for e in ledger["entries"]] == [
        (5, "checkpoint_0", [{"dataloader": 0, "epoch": 0, "batch": 5}])]

    status = json.loads((logs / "run_status.json").read_text())
    assert [attempt["verdict"]["state"] for attempt in status["attempts"]] == ["failed", "finished"]
    assert {rank["exit_code"] for rank in status["attempts"][0]["ranks"]} == {76}
    assert all(rank["rollback"]["checkpoint"].endswith("checkpoint_0") for rank in status["attempts"][0]["ranks"])

    metrics = [json.loads(line) for line in (project / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["values"]) for m in metrics if m["event"] == "log"] == [(5, {ROLLBACKS_METRIC: 1})]

