"""Checkpoints: the commit protocol, complete state, failures that lose nothing, bitwise resume.

In-process tests drive ``save_state``/``load_state`` on one process; the fault matrix kills rank 0
or rank 1 of the shared 2-rank gloo pool at every named phase of a save; the resume tests run
``tests/checkpoint/checkpoint_scripts/resumable_train.py`` as a user would (``python`` and ``torchrig
launch``), SIGKILL it, relaunch it, and compare with a run that was never interrupted.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torchrig import Accelerator
from torchrig.checkpoint import MANIFEST_NAME, CheckpointError, layout, temporaries
from torchrig.checkpoint.faults import FAULT_ENV, PHASES
from torchrig.config.options import ProjectConfiguration
from torchrig.testing.contracts import rank_environment
from torchrig.testing.pool import WorkerDied, checked_pool

SCRIPT = Path(__file__).parent / "checkpoint_scripts" / "resumable_train.py"
RUN_TIMEOUT = 180  # seconds a training subprocess may take before the test gives up (not a measurement)


# -- a small run -----------------------------------------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def make_run(project: Path | None = None, *, seed: int = 0, **project_options):
    torch.manual_seed(seed)
    options = {"project_dir": str(project)} if project is not None else {}
    options.update(project_options)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(**options))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.arange(24).float().unsqueeze(1).repeat(1, 4), torch.arange(24) % 2)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, scheduler, loader, counter


def train_steps(accelerator, model, optimizer, scheduler, iterator, steps: int, seen: list | None = None) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = next(iterator)
        if seen is not None:
            seen.extend(x[:, 0].long().tolist())
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the whole state round-trips -------------------------------------------------------------


def test_every_piece_of_state_round_trips_bit_equal(tmp_path):
    accelerator, model, optimizer, scheduler, loader, counter = make_run()
    iterator = iter(loader)
    train_steps(accelerator, model, optimizer, scheduler, iterator, 3)
    counter.value = 7
    accelerator.gradient_state.step = 1
    random.seed(5)
    np.random.seed(5)
    directory = accelerator.save_state(tmp_path / "ckpt")
    expected = (params(model), json.dumps(optimizer.state_dict(), default=str), scheduler.state_dict(),
                random.random(), float(np.random.rand()), torch.rand(3), [b[1].tolist() for b in iterator])

    train_steps(accelerator, model, optimizer, scheduler, iter(loader), 2)  # change everything
    counter.value, accelerator.gradient_state.step = 0, 0
    assert accelerator.load_state(tmp_path / "ckpt") == directory
    got = (params(model), json.dumps(optimizer.state_dict(), default=str), scheduler.state_dict(),
           random.random(), float(np.random.rand()), torch.rand(3), [b[1].tolist() for b in iter(loader)])
    assert same(got[0], expected[0])
    assert got[1:5] == expected[1:5]
    assert torch.equal(got[5], expected[5])
    assert got[6] == expected[6], "the dataloader must resume mid-epoch at the same sample"
    assert counter.value == 7 and accelerator.gradient_state.step == 1

    manifest = layout.read_manifest(directory)
    assert manifest["world_size"] == 1 and manifest["strategy"] == "single"
    names = {entry["path"] for entry in manifest["files"]}
    assert names == {"model.safetensors", "optimizer.safetensors", "scheduler.bin", "dl_state_dict.bin",
                     "custom_checkpoint_0.safetensors", "random_states_0.pkl"}
    for entry in manifest["files"]:
        assert entry["size"] == os.path.getsize(os.path.join(directory, entry["path"]))


def test_fp16_grad_scaler_is_checkpointed(tmp_path):
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.randn(3, 4)).float().sum())
    optimizer.step()
    scaler = accelerator._host.hook.torchrig_checkpoint_state(run=accelerator._run)
    (scaler,) = [c["scaler"] for c in scaler if c]
    scaler.update(1024.0)
    accelerator.save_state(tmp_path / "c")
    assert (tmp_path / "c" / "scaler.pt").exists()
    scaler.update(2.0)
    accelerator.load_state(tmp_path / "c")
    assert scaler.get_scale() == 1024.0


def test_automatic_naming_continues_after_a_resume_and_keeps_total_limit(tmp_path):
    accelerator, model, optimizer, scheduler, loader, _ = make_run(tmp_path, automatic_checkpoint_naming=True,
                                                                  total_limit=2)
    for _ in range(4):
        accelerator.save_state()
    root = tmp_path / "checkpoints"
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3", "latest"]
    assert (root / "latest").read_text().strip() == "checkpoint_3"

    resumed, *_ = make_run(tmp_path, automatic_checkpoint_naming=True, total_limit=2)
    assert resumed.save_iteration == 0
    assert resumed.load_state() == str(root / "checkpoint_3")
    assert resumed.save_iteration == 4
    assert resumed.save_state() == str(root / "checkpoint_4")  # Accelerate: "checkpoint_4 already exists"
    assert sorted(os.listdir(root)) == ["checkpoint_3", "checkpoint_4", "latest"]


def test_asking_to_resume_without_a_checkpoint_is_an_error_never_a_fresh_start(tmp_path):
    accelerator, *_ = make_run(tmp_path, automatic_checkpoint_naming=True)
    with pytest.raises(CheckpointError, match="no committed checkpoint in .*checkpoints"):
        accelerator.load_state()
    assert accelerator.latest_checkpoint() is None
    with pytest.raises(CheckpointError, match="no such directory"):
        accelerator.load_state(tmp_path / "missing")
    half = tmp_path / "half"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    with pytest.raises(CheckpointError, match="not a committed torchrig checkpoint"):
        accelerator.load_state(half)
    plain, *_ = make_run()
    with pytest.raises(CheckpointError, match="needs a checkpoint directory"):
        plain.load_state()
    with pytest.raises(CheckpointError, match="needs an output directory"):
        plain.save_state()


def _owned_by_a_dead_process(directory: Path) -> None:
    """Give ``directory`` the owner record of a process that has exited (a killed writer)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                           check=True, timeout=60)
    temporaries.write_owner(str(directory), {**temporaries.owner_record(), "pid": int(child.stdout),
                                             "start_time": None})


@pytest.mark.multiprocess
def test_leftovers_of_interrupted_saves_are_ignored_then_cleaned(tmp_path):
    accelerator, *_ = make_run(tmp_path, automatic_checkpoint_naming=True)
    first = accelerator.save_state()
    root = tmp_path / "checkpoints"
    stale, elsewhere = root / ".checkpoint_1.tmp-abc123", root / ".checkpoint_2.tmp-abc456"
    for directory in (stale, elsewhere):
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"x")
        (directory / MANIFEST_NAME).write_text(json.dumps({"format": layout.FORMAT, "sequence": 99}))  # no rename
    _owned_by_a_dead_process(stale)
    temporaries.write_owner(str(elsewhere), {**temporaries.owner_record(), "host": "another-node"})
    assert accelerator.latest_checkpoint() == first
    assert accelerator.load_state() == first
    assert not stale.exists() and not os.path.exists(f"{stale}{temporaries.OWNER_SUFFIX}")
    assert elsewhere.exists(), "a writer on another host may be alive: its directory is never removed from here"


@pytest.mark.multiprocess
def test_existing_checkpoint_is_refused_unless_overwrite_which_is_atomic(tmp_path, monkeypatch):
    accelerator, model, optimizer, scheduler, loader, _ = make_run()
    target = tmp_path / "ckpt"
    accelerator.save_state(target)
    with pytest.raises(CheckpointError, match="already there; pass save_state\\(..., overwrite=True\\)"):
        accelerator.save_state(target)
    train_steps(accelerator, model, optimizer, scheduler, iter(loader), 1)
    after = params(model)
    accelerator.save_state(target, overwrite=True)
    monkeypatch.setattr(layout, "exchange", lambda new, old: False)  # filesystems without RENAME_EXCHANGE
    accelerator.save_state(target, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    train_steps(accelerator, model, optimizer, scheduler, iter(loader), 1)
    accelerator.load_state(target)
    assert same(params(model), after)
    (tmp_path / "other").mkdir()
    with pytest.raises(CheckpointError, match="exists and is not a committed torchrig checkpoint"):
        accelerator.save_state(tmp_path / "other", overwrite=True)


@pytest.mark.multiprocess
def test_interrupted_overwrite_without_exchange_recovers_the_old_checkpoint(tmp_path):
    accelerator, *_ = make_run()
    target = tmp_path / "ckpt"
    accelerator.save_state(target)
    aside = layout.temporary_sibling(str(target), "replaced")
    os.rename(target, aside)  # killed between the two renames of an overwrite
    assert layout.remove_leftovers(str(tmp_path)) == [] and os.path.exists(aside), "no owner record: not ours"
    _owned_by_a_dead_process(Path(aside))
    assert layout.remove_leftovers(str(tmp_path)) == []
    assert layout.is_committed(str(target))


def test_changed_configuration_is_refused_with_a_diff_unless_allowed(tmp_path):
    accelerator, *_ = make_run()
    accelerator.save_state(tmp_path / "c")
    torch.manual_seed(0)
    other = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.zeros(24, 4), torch.zeros(24, dtype=torch.long))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    other.prepare(model, optimizer, scheduler, loader)
    other.register_for_checkpointing(Counter())
    with pytest.raises(CheckpointError) as info:
        other.load_state(tmp_path / "c")
    message = str(info.value)
    assert "gradient_accumulation_steps: checkpoint 1, now 4" in message
    assert "batch_size" in message and "allow_config_change=True" in message
    other.load_state(tmp_path / "c", allow_config_change=True)



def test_a_configuration_change_is_allowed_from_the_environment_for_scripts_that_cannot_pass_it(tmp_path,
                                                                                                 monkeypatch):
    accelerator, saved_model, *_ = make_run()
    accelerator.save_state(tmp_path / "c")
    monkeypatch.setenv("TORCHRIG_PROJECT_CONFIG__ALLOW_CONFIG_CHANGE", "true")
    other = Accelerator(cpu=True, gradient_accumulation_steps=4)  # refused without the variable (the test above)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.zeros(24, 4), torch.zeros(24, dtype=torch.long))
    model, *_ = other.prepare(model, optimizer, scheduler, torch.utils.data.DataLoader(data, batch_size=8))
    other.register_for_checkpointing(Counter())
    other.load_state(tmp_path / "c")
    assert same(params(model), params(saved_model))


def test_a_key_newer_than_the_checkpoint_left_at_its_default_is_no_configuration_change(tmp_path):
    # A release that adds a fingerprinted key must still resume the checkpoints written before it.
    accelerator, *_ = make_run()
    directory = Path(accelerator.save_state(tmp_path / "c"))
    manifest_path = directory / "torchrig_checkpoint.json"
    manifest = json.loads(manifest_path.read_text())
    recorded = manifest["fingerprint"]["config"]
    assert recorded.pop("gradient_accumulation_steps") == 1 and recorded.pop("mixed_precision") == "no"
    manifest_path.write_text(json.dumps(manifest))
    make_run()[0].load_state(directory)  # both at their defaults now: what the old run did
    changed = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.arange(24).float().unsqueeze(1).repeat(1, 4), torch.arange(24) % 2)
    changed.prepare(model, optimizer, scheduler, torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
    changed.register_for_checkpointing(Counter())
    with pytest.raises(CheckpointError) as info:
        changed.load_state(directory)  # set by this run: it may not be what the old run did
    assert "gradient_accumulation_steps: checkpoint '<absent>', now 4" in str(info.value)
    assert "mixed_precision" not in str(info.value)


def test_damaged_checkpoints_are_named_and_never_loaded(tmp_path):
    accelerator, *_ = make_run()
    directory = Path(accelerator.save_state(tmp_path / "c", hashes=True))
    weights_file = directory / "model.safetensors"
    data = bytearray(weights_file.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 3] ^= 0xFF  # a byte of tensor data, after the header
    weights_file.write_bytes(bytes(data))
    accelerator.load_state(directory, verify_hashes=False)  # sizes match: a check of sizes alone passes
    for verify in (None, True):  # by default, the hashes a checkpoint recorded are verified
        with pytest.raises(CheckpointError, match="model.safetensors: sha256 differs"):
            accelerator.load_state(directory, verify_hashes=verify)
    weights_file.write_bytes(bytes(data[:100]))
    with pytest.raises(CheckpointError, match=r"damaged \(model.safetensors: 100 bytes on disk"):
        accelerator.load_state(directory)


_DISK_FULL = textwrap.dedent("""
    import os, resource, signal, sys, torch
    from torchrig import Accelerator
    from torchrig.config.options import ProjectConfiguration
    from torchrig.checkpoint import CheckpointError
    root, async_save = sys.argv[1], sys.argv[2] == "async"
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=root, automatic_checkpoint_naming=True, async_save=async_save))
    model = torch.nn.Linear(256, 256)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerator.backward(model(torch.randn(2, 256)).sum()); optimizer.step()
    accelerator.save_state(); accelerator.wait_for_everyone()
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))  # the disk is "full"
    try:
        accelerator.save_state()
        accelerator.wait_for_everyone()
    except CheckpointError as exc:
        print("ERROR:", exc)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print("LISTING:", sorted(os.listdir(os.path.join(root, "checkpoints"))))
    print("LATEST:", accelerator.latest_checkpoint())
    print("AGAIN:", accelerator.save_state()); accelerator.wait_for_everyone()
""")


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_full_disk_is_a_clear_error_that_keeps_the_previous_checkpoint(tmp_path, mode):
    result = subprocess.run([sys.executable, "-c", _DISK_FULL, str(tmp_path), mode], capture_output=True, text=True,
                            timeout=RUN_TIMEOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "ERROR:" in out and "no space left while writing" in out and "previous checkpoint is intact" in out, out
    if mode == "async":
        assert "asynchronous save" in out
    assert "LISTING: ['checkpoint_0', 'latest']" in out, out  # no temporary directory left behind
    assert f"LATEST: {tmp_path}/checkpoints/checkpoint_0" in out
    assert f"AGAIN: {tmp_path}/checkpoints/checkpoint_2" in out  # later saves work; numbers never reused


def test_async_save_snapshots_at_the_call_and_commits_in_the_background(tmp_path):
    accelerator, model, optimizer, scheduler, loader, _ = make_run(tmp_path, automatic_checkpoint_naming=True)
    iterator = iter(loader)
    train_steps(accelerator, model, optimizer, scheduler, iterator, 2)
    expected = params(model)
    directory = accelerator.save_state(async_save=True)
    train_steps(accelerator, model, optimizer, scheduler, iterator, 2)  # training goes on meanwhile
    accelerator.wait_for_everyone()
    assert layout.is_committed(directory)
    accelerator.load_state()
    assert same(params(model), expected)


def test_save_model_writes_sharded_safetensors_with_an_index(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight  # tied weights share memory
    model = accelerator.prepare(model)
    assert accelerator.save_model(model, tmp_path / "out") == ["model.safetensors"]
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as handle:
        assert list(handle.keys()) == ["0.weight"]  # written once
        assert json.loads(handle.metadata()["torchrig_aliases"]) == {"1.weight": "0.weight"}
        assert torch.equal(handle.get_tensor("0.weight"), model[0].weight.detach())

    big = accelerator.prepare(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)]))
    written = accelerator.save_model(big, tmp_path / "big", max_shard_size="2KB")
    shards = [n for n in written if n.endswith(".safetensors")]
    assert len(shards) > 1 and all(n.startswith("model-000") for n in shards)
    index = json.loads((tmp_path / "big" / "model.safetensors.index.json").read_text())
    for name, file in index["weight_map"].items():
        with safe_open(tmp_path / "big" / file, framework="pt") as handle:
            assert torch.equal(handle.get_tensor(name), big.state_dict()[name])
    accelerator.save_model(big, tmp_path / "big", max_shard_size="1GB")  # stale shards go away
    assert sorted(os.listdir(tmp_path / "big")) == ["model.safetensors"]
    accelerator.save_model(big, tmp_path / "bin", safe_serialization=False)
    assert same(torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True), big.state_dict())
    with pytest.raises(ValueError, match="max_shard_size='ten'"):
        accelerator.save_model(big, tmp_path / "x", max_shard_size="ten")


def test_save_writes_one_object_atomically(tmp_path):
    accelerator = Accelerator(cpu=True)
    accelerator.save({"a": torch.ones(2)}, tmp_path / "obj.pt")
    assert torch.equal(torch.load(tmp_path / "obj.pt")["a"], torch.ones(2))
    accelerator.save({"a": torch.ones(2)}, tmp_path / "obj.safetensors", safe_serialization=True)
    assert torch.equal(load_file(tmp_path / "obj.safetensors")["a"], torch.ones(2))
    assert sorted(os.listdir(tmp_path)) == ["obj.pt", "obj.safetensors"]


def test_pre_hooks_can_take_over_saving_and_loading_a_model(tmp_path):
    accelerator, model, *_ = make_run()
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", len(models), len(weights)))
        torch.save(weights.pop(0), os.path.join(output_dir, "custom_model.pt"))
        models.pop(0)

    def load_hook(models, input_dir):
        calls.append(("load", len(models)))
        models[0].load_state_dict(torch.load(os.path.join(input_dir, "custom_model.pt")))
        models.pop(0)

    handles = [accelerator.register_save_state_pre_hook(save_hook), accelerator.register_load_state_pre_hook(load_hook)]
    directory = accelerator.save_state(tmp_path / "c")
    files = {entry["path"] for entry in layout.read_manifest(directory)["files"]}
    assert "custom_model.pt" in files and "model.safetensors" not in files
    expected = params(model)
    with torch.no_grad():
        model[0].weight.add_(1)
    accelerator.load_state(directory)
    assert same(params(model), expected)
    assert calls == [("save", 1, 1), ("load", 1)]
    for handle in handles:
        handle.remove()
    with pytest.raises(ValueError, match="lack state_dict"):
        accelerator.register_for_checkpointing(object())


# -- two ranks: world size, fault injection ----------------------------------------------------


def _two_rank_save(ctx, root: str, steps: int, fault: str | None = None):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, optimizer, scheduler, loader, _ = make_run(Path(root), automatic_checkpoint_naming=True,
                                                                      total_limit=2)
        iterator = iter(loader)
        saved, seen = {}, []
        for step in range(1, steps + 1):
            train_steps(accelerator, model, optimizer, scheduler, iterator, 1, seen)
            if fault is not None and step == steps:
                os.environ[FAULT_ENV] = fault
            directory = accelerator.save_state()
            saved[os.path.basename(directory)] = params(accelerator.unwrap_model(model))
        return saved, seen


def _two_rank_load(ctx, root: str, resave: bool = False):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, *_ = make_run(Path(root), automatic_checkpoint_naming=True, total_limit=2)
        directory = accelerator.load_state()
        loaded = params(accelerator.unwrap_model(model))
        again = accelerator.save_state() if resave else None
        return os.path.basename(directory), loaded, again


def test_resume_at_another_world_size_is_refused_unless_allowed(gloo_pool, tmp_path):
    (saved, seen0), (_, seen1) = gloo_pool.run(_two_rank_save, str(tmp_path), 2, timeout=120)
    accelerator, model, optimizer, scheduler, loader, _ = make_run(tmp_path, automatic_checkpoint_naming=True)
    with pytest.raises(CheckpointError, match="world size: checkpoint 2, now 1 .*allow_world_size_change=True"):
        accelerator.load_state()
    # A script that cannot pass the argument (transformers' no_trainer scripts) is set from the
    # configuration; an explicit argument still wins over it.
    configured, configured_model, *_ = make_run(tmp_path, automatic_checkpoint_naming=True,
                                                allow_world_size_change=True)
    with pytest.raises(CheckpointError, match="world size: checkpoint 2, now 1"):
        configured.load_state(allow_world_size_change=False)
    loaded_from = os.path.basename(configured.load_state())
    assert same(params(configured_model), saved[loaded_from])
    directory = accelerator.load_state(allow_world_size_change=True)
    assert same(params(model), saved[os.path.basename(directory)])
    # The position is kept in global samples: 2 steps x 2 ranks x 4 samples = 16 of 24 seen;
    # one process continues with exactly the 8 samples the two ranks had not seen yet.
    rest = [int(i) for x, _ in loader for i in x[:, 0].tolist()]
    assert len(seen0 + seen1) == 16 and sorted(seen0 + seen1 + rest) == list(range(24))


#: After a kill at (phase, rank), which save of three is the latest committed one.
def _expected_latest(phase: str, rank: int) -> str:
    committed = (rank == 0 and phase in ("before_latest", "before_rotation_delete")) or (
        rank == 1 and phase in ("before_manifest", "before_rename", "before_latest", "before_rotation_delete"))
    return "checkpoint_2" if committed else "checkpoint_1"


@pytest.fixture(scope="module")
def fault_pool():
    """Two ranks that are killed on purpose: the survivor, stuck in a collective with a dead
    peer, is given one second (not the shared pool's five) before the pool kills it."""
    with checked_pool(2, error_grace=1.0) as pool:
        yield pool


@pytest.mark.multiprocess
@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("phase", PHASES)
def test_a_rank_killed_at_any_phase_of_a_save_loses_nothing(fault_pool, tmp_path, phase, rank):
    reference = fault_pool.run(_two_rank_save, str(tmp_path / "reference"), 3, timeout=120)[0][0]
    with pytest.raises(WorkerDied, match=f"rank {rank}"):
        fault_pool.run(_two_rank_save, str(tmp_path / "run"), 3, f"{phase}@{rank}", timeout=120)
    results = fault_pool.run(_two_rank_load, str(tmp_path / "run"), True, timeout=120)
    expected = _expected_latest(phase, rank)
    for name, loaded, again in results:
        assert name == expected
        assert same(loaded, reference[expected]), "the checkpoint that loads must be bit-equal to what was saved"
        assert os.path.basename(again) == f"checkpoint_{int(expected[-1]) + 1}"
    leftovers = [n for n in os.listdir(tmp_path / "run" / "checkpoints") if n.startswith(".")]
    assert leftovers == []


# -- bitwise resume, as a user runs it -----------------------------------------------------------


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1")
    return env


def _train(tmp_path: Path, project: Path, guard, *args: str, processes: int = 1) -> subprocess.Popen:
    project.mkdir(exist_ok=True)
    launcher = [sys.executable, "-m", "torchrig", "launch", "--num_processes", str(processes),
                "--log_dir", str(project / "logs")] if processes > 1 else [sys.executable]
    proc = subprocess.Popen([*launcher, str(SCRIPT), str(project), *args], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(tmp_path))
    guard.track(proc)
    return proc


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    return proc.returncode, out


def _last_per_step(project: Path, rank: int) -> dict[int, dict]:
    entries: dict[int, dict] = {}
    for line in (project / f"log-rank{rank}.jsonl").read_text().splitlines():
        entry = json.loads(line)
        entries[entry["step"]] = entry  # a step replayed after a resume counts once, the last time
    return entries


def _assert_identical(a: Path, b: Path, ranks: int) -> None:
    first, second = torch.load(a / "final.pt", weights_only=False), torch.load(b / "final.pt", weights_only=False)
    assert same(first["params"], second["params"])
    for s1, s2 in zip(first["optimizer"]["state"].values(), second["optimizer"]["state"].values()):
        assert all(torch.equal(torch.as_tensor(s1[k]), torch.as_tensor(s2[k])) for k in s1)
    assert first["iteration"] == second["iteration"]
    for rank in range(ranks):
        assert _last_per_step(a, rank) == _last_per_step(b, rank), "losses and sample order must match step by step"


@pytest.mark.parametrize(("processes", "extra"), [(1, ()), (1, ("--async-save",)), (2, ())],
                         ids=["single", "single-async", "ddp-2"])
def test_kill_and_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, process_guard, processes, extra):
    code, out = _finish(_train(tmp_path, tmp_path / "straight", process_guard, "--steps", "12", *extra,
                               processes=processes))
    assert code == 0, out
    interrupted = tmp_path / "interrupted"
    code, out = _finish(_train(tmp_path, interrupted, process_guard, "--steps", "12", "--kill-after", "7", *extra,
                               processes=processes))
    assert code != 0
    assert not (interrupted / "final.pt").exists()
    code, out = _finish(_train(tmp_path, interrupted, process_guard, "--steps", "12", *extra, processes=processes))
    assert code == 0, out
    _assert_identical(tmp_path / "straight", interrupted, processes)


@pytest.mark.slow
def test_random_sigkills_of_every_process_during_training_lose_nothing(tmp_path, process_guard):
    """The issue's "done when": save every step with total_limit=2, SIGKILL everything at random
    moments, relaunch with load_state() each time, end bit-identical to an uninterrupted run."""
    steps = "150"  # long enough that most attempts are killed mid-run
    code, out = _finish(_train(tmp_path, tmp_path / "straight", process_guard, "--steps", steps, processes=2))
    assert code == 0, out
    project = tmp_path / "killed"
    rng = random.Random(20261122)
    kills = 0
    log = project / "log-rank0.jsonl"
    for _attempt in range(40):
        lines_before = len(log.read_text().splitlines()) if log.exists() else 0
        proc = _train(tmp_path, project, process_guard, "--steps", steps, processes=2)
        started = time.monotonic()
        while proc.poll() is None and time.monotonic() - started < RUN_TIMEOUT:  # until this attempt trains
            if log.exists() and len(log.read_text().splitlines()) > lines_before:
                break
            time.sleep(0.02)
        deadline = time.monotonic() + rng.uniform(0.0, 1.5)  # then a random moment: mid-step or mid-save
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.01)
        if proc.poll() is not None:
            assert proc.returncode == 0, proc.communicate()[0]
            break
        for pid in _worker_pids(project):
            with_suppressed_kill(pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=RUN_TIMEOUT)
        kills += 1
    else:
        pytest.fail("the run never finished")
    assert kills >= 3, "the loop must actually interrupt the run"
    _assert_identical(tmp_path / "straight", project, 2)


def _worker_pids(project: Path) -> list[int]:
    pids = []
    for status in (project / "logs").glob("*/rank-*.status.json"):
        data = json.loads(status.read_text() or "{}")
        if data.get("state") == "running" and data.get("pid"):
            pids.append(int(data["pid"]))
    return pids


def with_suppressed_kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
