"""The core's default answers, used by every strategy that does not replace them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from torchrig.checkpoint import CheckpointWriter
from torchrig.host.runtime import start_run
from torchrig.plugin.types import LaunchPlan, PreparedModel
from torchrig.testing import make_host, resolved_config


@pytest.fixture
def single_run():
    host = make_host()
    run = start_run(host, resolved_config({"use_cpu": True}, host=host), environ={})
    return host, run


def test_prepare_model_default_moves_to_device_and_keeps_optimizers(single_run):
    host, run = single_run
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    prepared = host.hook.torchrig_prepare_model(run=run, model=model, optimizers=[optimizer], schedulers=[], device_placement=True)
    assert isinstance(prepared, PreparedModel)
    assert prepared.model is model and prepared.unwrapped is model
    assert prepared.optimizers == [optimizer]
    assert next(model.parameters()).device == run.device.device


def test_plain_state_round_trips_through_a_directory(single_run, tmp_path):
    host, run = single_run
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    prepared = [host.hook.torchrig_prepare_model(run=run, model=model, optimizers=[optimizer], schedulers=[], device_placement=True)]
    writer = CheckpointWriter(str(tmp_path), rank=0, hashing=True)
    files = host.hook.torchrig_save_strategy_state(run=run, prepared=prepared, directory=str(tmp_path), writer=writer)
    assert sorted(files) == ["model.safetensors", "optimizer.safetensors"]
    assert [r.path for r in writer.records()] == ["model.safetensors", "optimizer.safetensors"]
    assert all(r.size == (tmp_path / r.path).stat().st_size and len(r.sha256) == 64 for r in writer.records())

    other = torch.nn.Linear(3, 2)
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    other(torch.randn(4, 3)).sum().backward()
    other_optimizer.step()
    target = [PreparedModel(model=other, unwrapped=other, optimizers=[other_optimizer])]
    assert host.hook.torchrig_load_strategy_state(run=run, prepared=target, directory=str(tmp_path), manifest={}, allow_pickle=False) is True
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], other_optimizer.state_dict()["state"][0]["exp_avg"])
    full = host.hook.torchrig_full_state_dict(run=run, prepared=prepared[0])
    assert set(full) == {"weight", "bias"}


def test_scheduler_default_steps_once_per_applied_optimizer_step(single_run):
    host, run = single_run
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    wrapped = host.hook.torchrig_prepare_scheduler(run=run, scheduler=scheduler, optimizers=[optimizer])
    optimizer.step()
    wrapped.step()
    assert wrapped.get_last_lr() == [0.5]
    optimizer.step_was_skipped = True  # what a prepared optimizer reports after an fp16 overflow
    wrapped.step()
    assert wrapped.get_last_lr() == [0.5]
    optimizer.step_was_skipped = False
    wrapped.step()
    assert scheduler.last_epoch == 2
    restored = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1.0), step_size=1, gamma=0.5)
    restored.load_state_dict(wrapped.state_dict())
    assert restored.last_epoch == 2


def test_dataloader_default_single_process_moves_batches(single_run):
    host, run = single_run
    data = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    loader = host.hook.torchrig_prepare_dataloader(run=run, dataloader=DataLoader(data, batch_size=4), device_placement=True)
    batches = list(loader)
    assert len(loader) == 3 and len(batches) == 3
    assert torch.equal(torch.cat([b[1] for b in batches]), torch.arange(10))
    assert batches[0][0].device == run.device.device


def test_sharding_splits_map_style_and_iterable_data_without_overlap():
    from torchrig.data import shard_dataloader

    data = TensorDataset(torch.arange(12))
    shards = [torch.cat([b[0] for b in shard_dataloader(DataLoader(data, batch_size=2), 2, r)]) for r in range(2)]
    assert sorted(torch.cat(shards).tolist()) == list(range(12))
    assert set(shards[0].tolist()).isdisjoint(shards[1].tolist())

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(9))

    # Each chunk of batch_size x world samples is one global batch; rank r takes the r-th slice.
    streams = [shard_dataloader(DataLoader(Stream(), batch_size=2), 3, r, even_batches=False) for r in range(3)]
    got = [sum((b.tolist() for b in loader), []) for loader in streams]
    assert got == [[0, 1, 6, 7], [2, 3, 8], [4, 5]]

    # A custom batch_sampler is sharded batch by batch, round-robin.
    custom = DataLoader(data, batch_sampler=[[0, 1], [2, 3], [4]])
    got = [[b[0].tolist() for b in shard_dataloader(custom, 2, r, even_batches=False)] for r in range(2)]
    assert got == [[[0, 1], [4]], [[2, 3]]]


@pytest.mark.multiprocess
def test_worker_environment_default_divides_cores():
    host = make_host()
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    code = textwrap.dedent(
        """
        from torchrig.testing import make_host
        from torchrig.plugin.types import LaunchPlan
        host = make_host()
        merged = {}
        for part in host.hook.torchrig_worker_environment(plan=LaunchPlan(command=["x"], nproc_per_node=64)):
            merged.update(part)
        print(merged)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.stdout.strip() == "{'OMP_NUM_THREADS': '1'}", result.stderr
    assert host.hook.torchrig_worker_environment(plan=LaunchPlan(command=["x"], nproc_per_node=1)) == [{}]


WORKER = """
import os, pathlib, sys
import torch.distributed as dist
out = pathlib.Path(sys.argv[1])
dist.init_process_group("gloo")
value = [None] * dist.get_world_size()
dist.all_gather_object(value, int(os.environ["RANK"]))
(out / f"rank{dist.get_rank()}.txt").write_text(f"{dist.get_world_size()} {sorted(value)} {os.environ['OMP_NUM_THREADS']}")
dist.destroy_process_group()
if os.environ.get("FAIL_RANK") == os.environ["RANK"]:
    sys.exit(3)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("fail", [False, True])
def test_launch_default_runs_workers_with_torch_elastic(tmp_path, process_guard, fail):
    """The default `torchrig_launch` starts N workers through torch elastic (in a child
    process, as `torchrig launch` will, so the test process keeps its own environment)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    launcher = textwrap.dedent(
        f"""
        import sys
        from torchrig.testing import make_host
        from torchrig.plugin.types import LaunchPlan
        host = make_host()
        plan = LaunchPlan(command=[sys.executable, {str(script)!r}, {str(tmp_path)!r}], nproc_per_node=2,
                          log_dir={str(tmp_path / "logs")!r},
                          env={{"OMP_NUM_THREADS": "1"{', "FAIL_RANK": "1"' if fail else ''}}})
        sys.exit(host.hook.torchrig_launch(plan=plan))
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    process_guard.track(proc.pid)
    output, _ = proc.communicate(timeout=150)
    assert proc.returncode == (1 if fail else 0), output
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == "2 [0, 1] 1"
    status = json.loads((tmp_path / "logs" / "run_status.json").read_text())  # even without the wrapper
    assert status["state"] == ("failed" if fail else "finished")
    assert status["exit_codes"]["1"] == (3 if fail else 0)
    if fail:  # rank 0 may be done, or torn down (SIGTERM) if it had not exited yet
        assert status["culprit"] == 1 and "rank 1 failed first (exit code 3: exited with code 3)" in output
