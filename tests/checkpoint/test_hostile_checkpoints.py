"""Checkpoints against an adversarial user (issue 18, the checkpoint half): each test reproduces one
case that did not hold — a lost last save, a reader destroying a save in progress, a planted pickle,
state that saves but cannot load, unrelated directories deleted, verification that verifies
nothing, manifest paths outside the checkpoint, a silent rollback past a damaged checkpoint, a
malformed manifest, and a run without a seed that could not resume.

Single-process cases run in this process; the exit-time cases run scripts from
``tests/checkpoint/checkpoint_scripts/`` as a user would (``python`` and ``torchrig launch``); the FSDP and
DeepSpeed loaders run on the shared 2-rank gloo pool.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrig import Accelerator
from torchrig.checkpoint import MANIFEST_NAME, CheckpointError, layout
from torchrig.config.options import DataLoaderConfiguration, ProjectConfiguration
from torchrig.testing.contracts import rank_environment

SCRIPTS = Path(__file__).parent / "checkpoint_scripts"
RUN_TIMEOUT = 180  # seconds a subprocess may take before the test gives up (not a measurement)


# -- a small run -----------------------------------------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class Planted:
    """What an attacker pickles: unpickling it calls ``open(marker, "w")`` — any code could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class Opaque:
    """A value only full unpickling restores (a class of the user's, not an allowed type)."""

    def __init__(self, value: int) -> None:
        self.value = value


def make_run(project: Path | None = None, *, seed: int | None = 0, batch_size: int = 4, data_seed: int | None = None,
             generator_seed: int | None = None, **project_options):
    """Model, AdamW, StepLR, a shuffled loader and a registered counter. ``seed=None`` never sets
    a seed: the global RNG starts from a fresh random state, as in a new process."""
    if seed is None:
        torch.seed()
    else:
        torch.manual_seed(seed)
    options = {"project_dir": str(project)} if project is not None else {}
    options.update(project_options)
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(**options),
                              dataloader_config=DataLoaderConfiguration(data_seed=data_seed))
    torch.manual_seed(0)  # the same weights whatever the loader's seed
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.arange(24).float().unsqueeze(1).repeat(1, 4), torch.arange(24) % 2)
    generator = torch.Generator().manual_seed(generator_seed) if generator_seed is not None else None
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, generator=generator)
    if seed is None:
        torch.seed()  # the loader's seed is drawn from the global RNG at prepare: a fresh one
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, scheduler, loader, counter


def train_step(accelerator, model, optimizer, scheduler, batch) -> None:
    x, y = batch
    accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rewrite_manifest(directory: Path, change) -> None:
    """Edit a committed manifest as an attacker or a damaged disk would (no fsync, no checks)."""
    path = directory / MANIFEST_NAME
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def plant(directory: Path, relative: str, data: bytes, *, replace_prefix: str | None = None) -> None:
    """Write ``relative`` into a checkpoint and make the manifest vouch for it (size and sha256):
    the attacker controls the whole directory, manifest included."""
    if replace_prefix is not None:
        for old in directory.glob(f"{replace_prefix}*"):
            old.unlink()
    (directory / relative).write_bytes(data)

    def change(manifest):
        files = [e for e in manifest["files"] if not (replace_prefix and e["path"].startswith(replace_prefix))
                 and e["path"] != relative]
        files.append({"path": relative, "size": len(data), "rank": 0, "sha256": hashlib.sha256(data).hexdigest()})
        manifest["files"] = files

    rewrite_manifest(directory, change)


def torch_bytes(obj) -> bytes:
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1")
    return env


def _run_script(tmp_path: Path, guard, script: str, *args: str, processes: int = 1, log_dir: Path | None = None
                ) -> tuple[int, str]:
    launcher = [sys.executable, "-m", "torchrig", "launch", "--num_processes", str(processes),
                "--log_dir", str(log_dir)] if processes > 1 else [sys.executable]
    proc = subprocess.Popen([*launcher, str(SCRIPTS / script), *args], start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_env(tmp_path))
    guard.track(proc)
    out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    return proc.returncode, out


# -- 1. the last asynchronous save of a script --------------------------------------------------


def test_the_last_async_save_of_a_script_commits_at_interpreter_exit(tmp_path, process_guard):
    code, out = _run_script(tmp_path, process_guard, "last_async_save.py", str(tmp_path / "p"))
    assert code == 0, out
    directory = tmp_path / "p" / "checkpoints" / "checkpoint_0"
    assert layout.is_committed(str(directory)), f"the last save was lost: {out}"
    names = {entry["path"] for entry in layout.read_manifest(str(directory))["files"]}
    assert {"model.safetensors", "optimizer.safetensors", "random_states_0.pkl"} <= names


def test_a_last_async_save_that_fails_at_exit_fails_the_process_naming_it(tmp_path, process_guard):
    code, out = _run_script(tmp_path, process_guard, "last_async_save.py", str(tmp_path / "p"), "--fail-rank", "0")
    assert code != 0, f"a lost checkpoint must not exit 0: {out}"
    assert "checkpoint_0" in out and "no space left" in out, out
    assert os.listdir(tmp_path / "p" / "checkpoints") == []  # nothing half-written left behind


@pytest.mark.multiprocess
def test_under_launch_every_rank_commits_the_last_async_save_at_exit(tmp_path, process_guard):
    logs = tmp_path / "logs"
    code, out = _run_script(tmp_path, process_guard, "last_async_save.py", str(tmp_path / "p"), processes=2,
                            log_dir=logs)
    assert code == 0, out
    directory = tmp_path / "p" / "checkpoints" / "checkpoint_0"
    manifest = layout.read_manifest(str(directory))
    assert manifest is not None, f"the last save was lost: {out}"
    names = {entry["path"] for entry in manifest["files"]}
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= names
    for rank in (0, 1):
        status = json.loads((logs / f"rank-{rank}.status.json").read_text())
        assert status["state"] == "finished" and status["last_checkpoint"] == str(directory)


@pytest.mark.multiprocess
def test_under_launch_a_rank_whose_last_async_save_failed_is_not_reported_finished(tmp_path, process_guard):
    logs = tmp_path / "logs"
    code, out = _run_script(tmp_path, process_guard, "last_async_save.py", str(tmp_path / "p"), "--fail-rank", "1",
                            processes=2, log_dir=logs)
    assert code != 0, out
    assert "FAILED" in out and "checkpoint_0" in out, out
    for rank in (0, 1):  # the save fails on every rank: the outcome is agreed
        status = json.loads((logs / f"rank-{rank}.status.json").read_text())
        assert status["state"] == "failed" and status["exit_code"] != 0, status
        assert "checkpoint_0" in status["error"], status
    assert os.listdir(tmp_path / "p" / "checkpoints") == []


# -- 2 and 5. cleanup touches only what provably belongs to a dead writer ------------------------


@pytest.mark.parametrize("total_limit", [None, 1])
def test_a_reader_never_destroys_a_save_in_progress(tmp_path, process_guard, total_limit):
    project = tmp_path / "p"
    project.mkdir()
    args = ["--total-limit", str(total_limit)] if total_limit else []
    writer = subprocess.Popen([sys.executable, str(SCRIPTS / "blocking_writer.py"), str(project), *args],
                              start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(tmp_path))
    process_guard.track(writer)
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (project / "paused").exists():
        assert writer.poll() is None, writer.communicate()[0]
        assert time.monotonic() < deadline, "the writer never reached its pause"
        time.sleep(0.05)
    try:
        _read_and_write_beside_the_paused_writer(project, writer, total_limit)
    finally:
        (project / "go").touch()  # never leave the writer waiting, whatever failed


def _read_and_write_beside_the_paused_writer(project: Path, writer: subprocess.Popen, total_limit) -> None:
    temporary = Path((project / "paused").read_text())
    assert temporary.is_dir()

    # An evaluator loads the newest checkpoint and writes a snapshot of its own into the same folder.
    reader = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(project)))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    model, optimizer = reader.prepare(model, torch.optim.AdamW(model.parameters()))
    root = project / "checkpoints"
    assert reader.load_state(root) == str(root / "checkpoint_0")
    snapshot = reader.save_state(root / "evaluator_snapshot")
    assert temporary.is_dir() and (temporary / "hook_notes.txt").exists(), "a reader removed a save in progress"

    (project / "go").touch()
    out, _ = writer.communicate(timeout=RUN_TIMEOUT)
    assert writer.returncode == 0, out
    committed = root / "checkpoint_1"
    manifest = layout.read_manifest(str(committed))
    listed = {entry["path"] for entry in manifest["files"]}
    on_disk = {str(p.relative_to(committed)) for p in committed.rglob("*") if p.is_file()} - {MANIFEST_NAME}
    assert listed == on_disk and "hook_notes.txt" in listed
    assert {"model.safetensors", "optimizer.safetensors"} <= listed
    reader.load_state(root)
    assert same(params(reader.unwrap_model(model)), torch.load(project / "saved.pt"))
    assert layout.is_committed(snapshot), "rotation deleted another job's checkpoint"
    expected = {"checkpoint_1", "evaluator_snapshot", "latest"} | ({"checkpoint_0"} if total_limit is None else set())
    assert set(os.listdir(root)) == expected


def test_loading_and_saving_leave_look_alike_directories_alone(tmp_path):
    accelerator, *_ = make_run(tmp_path, automatic_checkpoint_naming=True)
    accelerator.save_state()
    root = tmp_path / "checkpoints"
    unrelated = [root / ".notes.tmp-abcdef", root / ".checkpoint_9.tmp-0123456789ab", root / ".data.deleting-beef"]
    for path in unrelated:
        path.mkdir()
        (path / "keep.txt").write_text("not torchrig's")
    accelerator.load_state()
    accelerator.save_state()
    for path in unrelated:
        assert (path / "keep.txt").read_text() == "not torchrig's"


def test_a_leftover_is_reclaimed_only_once_its_owner_is_provably_gone(tmp_path, process_guard):
    from torchrig.checkpoint import temporaries

    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    process_guard.track(owner)
    leftover = tmp_path / ".checkpoint_3.tmp-abc123"
    leftover.mkdir()
    start = temporaries.process_start_time(owner.pid)
    try:
        temporaries.write_owner(str(leftover), {**temporaries.owner_record(), "pid": owner.pid, "start_time": start})
        assert layout.remove_leftovers(str(tmp_path)) == [] and leftover.is_dir(), "its writer is alive"
        temporaries.write_owner(str(leftover), {**temporaries.owner_record(), "pid": owner.pid,
                                                "start_time": (start or 0) + 1})  # the pid now names another process
        assert layout.remove_leftovers(str(tmp_path)) == [str(leftover)]
        assert os.listdir(tmp_path) == [], "the owner record goes with its directory"
    finally:
        owner.kill()
        owner.wait(timeout=RUN_TIMEOUT)


def test_a_file_that_vanished_before_the_commit_fails_the_save(tmp_path, monkeypatch):
    from torchrig.checkpoint import faults

    accelerator, *_ = make_run(tmp_path, automatic_checkpoint_naming=True, total_limit=1)
    first = accelerator.save_state()
    real_point = faults.point

    def vanish(phase, rank=None):  # someone deletes a written file just before the manifest
        if phase == "before_manifest":
            for temporary in layout.leftovers(str(tmp_path / "checkpoints")):
                os.unlink(os.path.join(temporary, "scheduler.bin"))
        real_point(phase, rank)

    monkeypatch.setattr(faults, "point", vanish)
    with pytest.raises(CheckpointError, match="scheduler.bin"):
        accelerator.save_state()
    monkeypatch.setattr(faults, "point", real_point)
    assert accelerator.latest_checkpoint() == first and layout.is_committed(first)
    assert accelerator.load_state() == first


# -- 3. loading never executes code unless asked to ----------------------------------------------


def test_registered_objects_are_stored_without_pickle(tmp_path):
    accelerator, *_, counter = make_run()
    counter.value = 7
    directory = Path(accelerator.save_state(tmp_path / "c"))
    names = {entry["path"] for entry in layout.read_manifest(str(directory))["files"]}
    assert "custom_checkpoint_0.safetensors" in names and not any(n.endswith(".pkl") and "custom" in n for n in names)
    counter.value = 0
    accelerator.load_state(directory)
    assert counter.value == 7


def test_a_planted_pickle_never_runs_on_load_even_with_verified_hashes(tmp_path):
    accelerator, *_ = make_run()
    directory = Path(accelerator.save_state(tmp_path / "c", hashes=True))
    marker = tmp_path / "code-ran"
    plant(directory, "custom_checkpoint_0.pkl", torch_bytes({"value": Planted(marker)}),
          replace_prefix="custom_checkpoint_0")
    with pytest.raises(CheckpointError, match=r"custom_checkpoint_0\.pkl.*allow_pickle=True"):
        accelerator.load_state(directory, verify_hashes=True)
    assert not marker.exists(), "loading a checkpoint executed code from it"


def test_old_pickled_registered_objects_load_safely_or_with_the_explicit_opt_in(tmp_path):
    accelerator, *_, counter = make_run()
    directory = Path(accelerator.save_state(tmp_path / "c"))
    plant(directory, "custom_checkpoint_0.pkl", torch_bytes({"value": 5}), replace_prefix="custom_checkpoint_0")
    accelerator.load_state(directory)  # plain values: read with weights_only, no opt-in needed
    assert counter.value == 5
    plant(directory, "custom_checkpoint_0.pkl", torch_bytes({"value": Opaque(9)}), replace_prefix="custom_checkpoint_0")
    with pytest.raises(CheckpointError) as info:
        accelerator.load_state(directory)
    message = str(info.value)
    assert "custom_checkpoint_0.pkl" in message and "Opaque" in message and "allow_pickle=True" in message
    assert "only if you trust" in message
    accelerator.load_state(directory, allow_pickle=True)
    assert isinstance(counter.value, Opaque) and counter.value.value == 9


# -- 4. whatever save_state writes, load_state reads ---------------------------------------------


@pytest.mark.parametrize(("where", "value", "named"), [
    ("optimizer", np.zeros(3), "numpy.ndarray"),
    ("optimizer", Fraction(1, 3), "fractions.Fraction"),
    ("optimizer", datetime.datetime(2024, 1, 2), "datetime.datetime"),
    ("scheduler", np.float64(0.5), "numpy.float64"),
], ids=["optimizer-ndarray", "optimizer-fraction", "optimizer-datetime", "scheduler-numpy-scalar"])
def test_state_that_could_not_be_loaded_back_is_refused_at_save(tmp_path, where, value, named):
    accelerator, model, optimizer, scheduler, loader, _ = make_run(tmp_path, automatic_checkpoint_naming=True)
    train_step(accelerator, model, optimizer, scheduler, next(iter(loader)))
    good = accelerator.save_state()
    if where == "optimizer":
        first = next(iter(optimizer.optimizer.state.values()))
        first["step_info"] = value
        expected = r"optimizer 0: \['state'\]\[\d+\]\['step_info'\]"
    else:
        scheduler.scheduler.best_metric = value
        expected = r"scheduler 0: \['best_metric'\]"
    with pytest.raises(CheckpointError) as info:
        accelerator.save_state()
    message = str(info.value)
    assert __import__("re").search(expected, message), message
    assert named in message and "weights_only" in message, message
    assert accelerator.latest_checkpoint() == good
    assert [n for n in os.listdir(tmp_path / "checkpoints") if n.startswith(".")] == []
    if where == "optimizer":
        del first["step_info"]
    else:
        del scheduler.scheduler.best_metric
    accelerator.load_state(accelerator.save_state())  # later saves work and load


# -- 6 and 7. what verification means, and where manifest paths may point -----------------------


def test_verify_hashes_on_a_checkpoint_saved_without_hashes_is_an_error(tmp_path):
    accelerator, *_ = make_run()
    directory = Path(accelerator.save_state(tmp_path / "c"))
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"cannot verify .*{directory.name}.*saved without hashes"):
        accelerator.load_state(directory, verify_hashes=True)


def test_verify_hashes_refuses_files_the_manifest_does_not_vouch_for(tmp_path):
    accelerator, *_ = make_run()
    directory = Path(accelerator.save_state(tmp_path / "c", hashes=True))
    (directory / "custom_checkpoint_0.pkl").write_bytes(torch_bytes({"value": 3}))
    with pytest.raises(CheckpointError, match=r"custom_checkpoint_0\.pkl.*not in the manifest"):
        accelerator.load_state(directory, verify_hashes=True)


_HASH_DEV_ZERO = """
import json, sys, torch
from torchrig import Accelerator
from torchrig.checkpoint import CheckpointError
directory = sys.argv[1]
accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(2, 2)
accelerator.prepare(model)
accelerator.save_state(directory, hashes=True)
path = directory + "/torchrig_checkpoint.json"
manifest = json.load(open(path))
manifest["files"].append({"path": "/dev/zero", "size": 0, "rank": 0, "sha256": "0" * 64})
json.dump(manifest, open(path, "w"))
try:
    accelerator.load_state(directory, verify_hashes=True)
except CheckpointError as exc:
    print("REFUSED:", exc)
"""


@pytest.mark.multiprocess
def test_a_manifest_path_to_a_device_is_refused_before_it_is_read(tmp_path):
    result = subprocess.run([sys.executable, "-c", _HASH_DEV_ZERO, str(tmp_path / "c")], capture_output=True,
                            text=True, timeout=60, env=_env(tmp_path))  # before the fix: hashes /dev/zero forever
    assert result.returncode == 0, result.stderr
    assert "REFUSED:" in result.stdout and "/dev/zero" in result.stdout and "inside the checkpoint" in result.stdout


@pytest.mark.parametrize("how", ["parent", "absolute", "symlink"])
def test_manifest_paths_must_be_regular_files_inside_the_checkpoint(tmp_path, how):
    accelerator, *_ = make_run()
    directory = Path(accelerator.save_state(tmp_path / "c"))
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((directory / "model.safetensors").read_bytes())
    if how == "symlink":
        (directory / "model.safetensors").unlink()
        (directory / "model.safetensors").symlink_to(outside)
        expected = "model.safetensors.*not a regular file"
    else:
        entry = "../outside.safetensors" if how == "parent" else str(outside)

        def point_outside(manifest):
            for record in manifest["files"]:
                if record["path"] == "model.safetensors":
                    record["path"] = entry

        rewrite_manifest(directory, point_outside)
        expected = "outside.safetensors.*inside the checkpoint"
    with pytest.raises(CheckpointError, match=expected):
        accelerator.load_state(directory)


# -- 8. a damaged newest checkpoint is reported, and saving goes on ------------------------------


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_a_damaged_newest_checkpoint_is_reported_never_silently_skipped(tmp_path, damage):
    accelerator, model, optimizer, scheduler, loader, _ = make_run(tmp_path, automatic_checkpoint_naming=True)
    accelerator.save_state()
    older = accelerator.save_state()
    newest = Path(accelerator.save_state())
    manifest = newest / MANIFEST_NAME
    if damage == "deleted":
        manifest.unlink()
    else:
        manifest.write_text(manifest.read_text()[:40])

    resumed, *_ = make_run(tmp_path, automatic_checkpoint_naming=True)
    for call in (resumed.load_state, resumed.latest_checkpoint):
        with pytest.raises(CheckpointError) as info:
            call()
        message = str(info.value)
        assert str(newest) in message and "skip_damaged=True" in message, message
        assert ("no manifest" if damage == "deleted" else "unreadable") in message, message
    assert resumed.latest_checkpoint(skip_damaged=True) == older
    assert resumed.load_state(skip_damaged=True) == older
    assert resumed.save_state() == str(tmp_path / "checkpoints" / "checkpoint_3")  # past the damaged one
    assert resumed.load_state() == str(tmp_path / "checkpoints" / "checkpoint_3")


def test_saving_goes_on_when_the_only_checkpoint_lost_its_manifest(tmp_path):
    accelerator, *_ = make_run(tmp_path, automatic_checkpoint_naming=True)
    only = Path(accelerator.save_state())
    (only / MANIFEST_NAME).unlink()
    resumed, *_ = make_run(tmp_path, automatic_checkpoint_naming=True)
    with pytest.raises(CheckpointError, match="checkpoint_0.*no manifest"):
        resumed.latest_checkpoint()
    assert resumed.latest_checkpoint(skip_damaged=True) is None
    first = resumed.save_state()
    second = resumed.save_state()
    assert [os.path.basename(first), os.path.basename(second)] == ["checkpoint_1", "checkpoint_2"]
    assert (only / "model.safetensors").exists(), "the damaged checkpoint is evidence: it is not deleted"


# -- 12. a malformed manifest is a checkpoint error naming the file and the field ----------------


def _set(key, value):
    def change(manifest):
        manifest[key] = value
    return change


def _set_file_field(key, value):
    def change(manifest):
        if value is KeyError:
            del manifest["files"][0][key]
        else:
            manifest["files"][0][key] = value
    return change


@pytest.mark.parametrize(("change", "field"), [
    (_set("sequence", "abc"), "sequence"),
    (_set("files", "x"), "files"),
    (_set_file_field("size", "big"), r"files\[0\]\.size"),
    (_set_file_field("path", KeyError), r"files\[0\]\.path"),
    (_set("world_size", [2]), "world_size"),
    (_set("contents", {"models": "one"}), r"contents\.models"),
    (_set("fingerprint", {"config": 5}), r"fingerprint\.config"),
    (_set("iteration", "x"), "iteration"),
], ids=["sequence", "files", "size", "path", "world_size", "contents", "fingerprint", "iteration"])
def test_a_manifest_with_wrong_field_types_is_a_checkpoint_error(tmp_path, change, field):
    accelerator, *_ = make_run(tmp_path, automatic_checkpoint_naming=True)
    directory = Path(accelerator.save_state())
    rewrite_manifest(directory, change)
    for where in (directory, tmp_path / "checkpoints"):
        with pytest.raises(CheckpointError, match=rf"{MANIFEST_NAME}.*{field}"):
            accelerator.load_state(where)


# -- 14. a run that never sets a seed resumes; a changed data order is still refused -------------


def test_a_run_that_never_sets_a_seed_resumes_with_the_saved_loader_seed(tmp_path):
    accelerator, model, optimizer, scheduler, loader, _ = make_run(tmp_path, seed=None)
    iterator = iter(loader)
    train_step(accelerator, model, optimizer, scheduler, next(iterator))
    directory = accelerator.save_state(tmp_path / "c")
    saved_seed = loader.state_dict()["seed"]
    rest = [x[:, 0].tolist() for x, _ in iterator]

    resumed, _, _, _, loader2, _ = make_run(tmp_path, seed=None)
    assert loader2.state_dict()["seed"] != saved_seed  # a new process draws another seed
    resumed.load_state(directory)
    assert loader2.state_dict()["seed"] == saved_seed
    assert [x[:, 0].tolist() for x, _ in loader2] == rest, "the resumed run continues the saved order"


@pytest.mark.parametrize("change", ["batch_size", "data_seed", "generator"])
def test_a_changed_data_order_is_still_refused(tmp_path, change):
    saved_with = {"generator_seed": 1} if change == "generator" else ({"data_seed": 1} if change == "data_seed" else {})
    accelerator, *_ = make_run(tmp_path, seed=None, **saved_with)
    directory = accelerator.save_state(tmp_path / "c")
    now = {"batch_size": {"batch_size": 6}, "data_seed": {"data_seed": 2}, "generator": {"generator_seed": 2}}[change]
    resumed, *_ = make_run(tmp_path, seed=None, **now)
    with pytest.raises(CheckpointError, match="configuration changed"):
        resumed.load_state(directory)
    resumed.load_state(directory, allow_config_change=True)


# -- 3, continued: the strategies' own loaders ---------------------------------------------------


def _fsdp_save_then_load(ctx, directory: str) -> str:
    with rank_environment(ctx.rank, ctx.world_size):
        from torchrig_fsdp.options import FullyShardedDataParallelPlugin

        def run():
            accelerator = Accelerator(cpu=True, strategy="fsdp",
                                      fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
            return (accelerator, *accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01)))

        accelerator, model, optimizer = run()
        accelerator.backward(model(torch.randn(2, 4)).sum())
        optimizer.step()
        if not os.path.exists(directory):
            accelerator.save_state(directory)
        accelerator, model, optimizer = run()
        try:
            accelerator.load_state(directory)
        except CheckpointError as exc:
            return f"refused: {exc}"
        return "loaded"


@pytest.mark.multiprocess
def test_fsdp_sharded_checkpoints_load_without_unpickling_and_refuse_a_planted_pickle(gloo_pool, tmp_path):
    import pickle

    directory = tmp_path / "fsdp"
    assert gloo_pool.run(_fsdp_save_then_load, str(directory), timeout=RUN_TIMEOUT) == ["loaded", "loaded"]
    marker = tmp_path / "code-ran"
    plant(directory, "pytorch_model_fsdp_0/.metadata", pickle.dumps(Planted(marker)))
    results = gloo_pool.run(_fsdp_save_then_load, str(directory), timeout=RUN_TIMEOUT)
    assert not marker.exists(), "loading an FSDP checkpoint executed code from it"
    assert all(r.startswith("refused") and ".metadata" in r and "allow_pickle=True" in r for r in results), results


def _deepspeed_save_then_load(ctx, directory: str) -> str:
    with rank_environment(ctx.rank, ctx.world_size):
        from torchrig_deepspeed.options import DeepSpeedPlugin

        def run():
            accelerator = Accelerator(cpu=True, strategy="deepspeed", deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            return (accelerator, *accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01)))

        accelerator, model, optimizer = run()
        accelerator.backward(model(torch.randn(2, 4)).sum())
        optimizer.step()
        if not os.path.exists(directory):
            accelerator.save_state(directory)
        del accelerator, model, optimizer
        accelerator, model, optimizer = run()
        try:
            accelerator.load_state(directory)
        except CheckpointError as exc:
            return f"refused: {exc}"
        return "loaded"


@pytest.mark.multiprocess
def test_deepspeed_checkpoints_load_without_unpickling_and_refuse_a_planted_pickle(gloo_pool, tmp_path):
    directory = tmp_path / "ds"
    assert gloo_pool.run(_deepspeed_save_then_load, str(directory), timeout=RUN_TIMEOUT) == ["loaded", "loaded"]
    marker = tmp_path / "code-ran"
    plant(directory, "pytorch_model/mp_rank_00_model_states.pt", torch_bytes({"module": Planted(marker)}))
    results = gloo_pool.run(_deepspeed_save_then_load, str(directory), timeout=RUN_TIMEOUT)
    assert not marker.exists(), "loading a DeepSpeed checkpoint executed code from it"
    assert all(r.startswith("refused") and "mp_rank_00_model_states.pt" in r and "allow_pickle=True" in r
               for r in results), results
