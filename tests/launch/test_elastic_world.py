"""Elastic world size (issue 38): ``torchrig launch --num_machines MIN:MAX``.

The flag's parsing and its refusals (exit 2, naming the flag); the c10d rendezvous it configures
really closes a round with fewer machines than MAX (a real round on loopback); and the done-when:
two launchers ("machines") on loopback, one killed with ``kill -9`` on its process group mid-run,
the other goes on alone from the last commit and ends with the parameters of a reference run
resumed on one rank from that same checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torchrig.config.options import CoreOptions, ParallelismConfig
from torchrig.errors import ConfigError
from torchrig.launch.cli import main, split_machine_range
from torchrig.launch.rendezvous import free_port, rendezvous_handler
from torchrig.plugin.types import LaunchPlan

SCRIPTS = Path(__file__).parent / "launch_scripts"
STEPS = 24  # optimizer steps of the whole run; checkpoint after each
KILL_AFTER = 4  # committed checkpoints before machine 1 is killed


def test_num_machines_range_is_max_and_min_machines():
    assert split_machine_range(["--cpu", "--num_machines", "1:2"]) == [
        "--cpu", "--num_machines", "2", "--min_machines", "1"]
    assert split_machine_range(["--num_machines=2:4"]) == ["--num_machines", "4", "--min_machines", "2"]
    assert split_machine_range(["--num_machines", "3"]) == ["--num_machines", "3"]


@pytest.mark.parametrize(("flags", "named"), [
    (["--num_machines", "3:2"], "--num_machines 3:2"),
    (["--num_machines", "a:2"], "--num_machines a:2"),
    (["--num_machines", "0:2"], "--num_machines 0:2"),
    (["--num_machines", "1:2", "--rdzv_backend", "static"], "min_machines 1"),
    (["--num_machines", "2", "--min_machines", "3"], "min_machines 3 is above num_machines 2"),
])
def test_bad_machine_range_is_exit_2_naming_it(flags, named, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    code = main([*flags, "--cpu", "--main_process_ip", "127.0.0.1", "--main_process_port", "29500",
                 "--dry_run", str(script)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert named in err and "Traceback" not in err


ELASTIC = ["--num_machines", "1:2", "--strategy", "fsdp"]


@pytest.mark.parametrize(("flags", "named"), [
    # a round of 1 machine (2 ranks... or 1 with the processes defaulted) cannot keep tp 2 x pp 2 / tp 2
    ([*ELASTIC, "--num_processes", "4", "--tp_size", "2", "--pp_size", "2"],
     ["parallelism_config.dp_shard_size", "round of 1 machine(s)", "2 ranks", "tp_size=2 x parallelism_config.pp_size=2"]),
    ([*ELASTIC, "--tp_size", "2"], ["parallelism_config.dp_shard_size", "round of 1 machine(s)", "1 ranks", "tp_size=2"]),
    # expert parallelism borrows from dp_shard: the re-derived dp_shard 2 of one machine cannot hold ep 4
    ([*ELASTIC, "--num_processes", "4", "--dp_shard_size", "4", "--ep_size", "4"],
     ["parallelism_config.ep_size", "ep_size=4 does not divide parallelism_config.dp_shard_size 2"]),
    ([*ELASTIC, "--num_processes", "4", "--dp_shard_size", "2", "--tp_size", "-1"],
     ["parallelism_config.tp_size", "-1 in an elastic run", "dp_shard_size absorbs"]),
    (["--num_processes", "2", "--strategy", "fsdp", "--elastic_axis", "dp_shard"],
     ["parallelism_config.elastic_axis", "has no effect", "--num_machines MIN:MAX"]),
])
def test_an_elastic_world_that_cannot_keep_the_fixed_axes_is_exit_2_naming_them(flags, named, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    code = main([*flags, "--cpu", "--main_process_ip", "127.0.0.1", "--main_process_port", "29500",
                 "--dry_run", str(script)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert all(text in err for text in named) and "Traceback" not in err, err


@pytest.mark.parametrize("flags", [
    [*ELASTIC, "--num_processes", "4", "--tp_size", "2", "--dp_shard_size", "2"],
    [*ELASTIC, "--num_processes", "4", "--tp_size", "2", "--dp_replicate_size", "2", "--elastic_axis", "dp_replicate"],
    [*ELASTIC, "--num_processes", "4", "--dp_shard_size", "4", "--ep_size", "2"],
])
def test_an_elastic_world_whose_rounds_all_keep_the_fixed_axes_launches(flags, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    code = main([*flags, "--cpu", "--main_process_ip", "127.0.0.1", "--main_process_port", "29500",
                 "--dry_run", str(script)])
    assert code == 0, capsys.readouterr().err


def test_the_elastic_axis_policy():
    """Which axis absorbs a world-size change: the one named, else dp_replicate when it is -1, else
    dp_shard; none when the world is fixed (min_machines unset or equal to num_machines)."""
    elastic, fixed = CoreOptions(num_machines=2, min_machines=1), CoreOptions(num_machines=2, min_machines=2)
    assert ParallelismConfig(tp_size=2).elastic_axis_for(elastic) == "dp_shard"
    assert ParallelismConfig(dp_replicate_size=-1, tp_size=2).elastic_axis_for(elastic) == "dp_replicate"
    assert ParallelismConfig(dp_replicate_size=2, elastic_axis="dp_replicate").elastic_axis_for(elastic) == "dp_replicate"
    assert ParallelismConfig(tp_size=2).elastic_axis_for(fixed) is None
    assert ParallelismConfig(tp_size=2).elastic_axis_for(CoreOptions(num_machines=2)) is None


def test_a_round_the_mesh_cannot_fit_is_refused_at_start_naming_the_world_and_the_fixed_axes():
    """What the fsdp strategy does with each round's world (its mesh): dp_shard re-derived, tp, pp
    and ep kept; a world that cannot hold them is a ConfigError naming the world size, the fixed axes
    and the key — not a hang, not a different layout."""
    mesh_layout = pytest.importorskip("torchrig_fsdp.mesh").mesh_layout
    config = ParallelismConfig(tp_size=2, dp_shard_size=2, elastic_axis="dp_shard")
    assert mesh_layout(config, 2) == ((1, 2), ("dp_shard", "tp"))
    assert mesh_layout(config, 6) == ((3, 2), ("dp_shard", "tp"))
    hsdp = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2, elastic_axis="dp_replicate")  # a replica a machine
    assert mesh_layout(hsdp, 2) == ((2,), ("dp_shard",))
    assert mesh_layout(hsdp, 6) == ((3, 2), ("dp_replicate", "dp_shard"))
    with pytest.raises(ConfigError) as refused:
        mesh_layout(config, 3)
    assert "parallelism_config.dp_shard_size" in str(refused.value)
    assert "round of 3 ranks" in str(refused.value) and "parallelism_config.tp_size=2" in str(refused.value)
    with pytest.raises(ConfigError, match="parallelism_config.ep_size: ep_size=2 does not divide"):
        mesh_layout(ParallelismConfig(dp_shard_size=4, ep_size=2, elastic_axis="dp_shard"), 3)
    with pytest.raises(ConfigError, match="sizes multiply to 4"):  # a fixed world keeps today's rule
        mesh_layout(ParallelismConfig(tp_size=2, dp_shard_size=2), 2)


def test_elastic_rendezvous_goes_on_with_the_minimum():
    """``--num_machines 1:2`` with one machine up: the c10d round closes with a world of 1 once
    the last call has passed, instead of waiting for the second machine (node rank 0: the round's)."""
    endpoint = f"127.0.0.1:{free_port()}"
    plan = LaunchPlan(command=["true"], num_nodes=2, min_nodes=1, node_rank=0, rdzv_backend="c10d",
                      rdzv_endpoint=endpoint, master_addr="127.0.0.1",
                      rdzv_configs={"join_timeout": 20, "last_call_timeout": 1})
    handler, _, _ = rendezvous_handler(plan)
    started = time.monotonic()
    try:
        info = handler.next_rendezvous()
    finally:
        handler.shutdown()
    assert (info.rank, info.world_size) == (0, 1)
    assert time.monotonic() - started < 15
    assert info.bootstrap_store_info.master_addr == "127.0.0.1"


def _launch(tmp_path: Path, guard, *args: str, stderr=subprocess.PIPE) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torchrig", "launch", "--cpu", *args], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    guard.track(proc)
    return proc


def _committed(project: Path) -> list[str]:
    folder = project / "checkpoints"
    return sorted(p.name for p in folder.glob("checkpoint_*")) if folder.is_dir() else []


def _kill_one_of_two_machines(tmp_path: Path, guard, script: str, flags: list[str], steps: int,
                              *script_args: str) -> tuple[Path, Path, str]:
    """Two launchers ("machines") on loopback, ``--num_machines 1:2``; machine 1's process group
    killed with ``kill -9`` after :data:`KILL_AFTER` commits; machine 0 must go on alone and finish.
    Returns the output folder, the project and machine 0's stderr."""
    out, project = tmp_path / "out", tmp_path / "project"
    out.mkdir()
    port = free_port()
    common = ["--num_machines", "1:2", *flags, "--main_process_ip", "127.0.0.1",
              "--main_process_port", str(port), "--max_restarts", "3",
              "--rdzv_conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"]
    arguments = [str(SCRIPTS / script), str(out), str(project), str(steps), *script_args]
    survivor, victim = (_launch(tmp_path, guard, *common, "--machine_rank", str(machine),
                                "--log_dir", str(tmp_path / f"logs{machine}"), *arguments) for machine in (0, 1))
    deadline = time.monotonic() + 60
    while len(_committed(project)) < KILL_AFTER:
        assert survivor.poll() is None and victim.poll() is None, (survivor.communicate(), victim.communicate())
        assert time.monotonic() < deadline, "the two machines never committed their checkpoints"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=30)
    _, err = survivor.communicate(timeout=90)
    for ready in out.glob("ready-*"):
        guard.track(int(ready.read_text()))
    assert survivor.returncode == 0, err
    # one restart for the kill; a second only when another process took the round's master port first
    # (EADDRINUSE: the port is chosen free, then bound by the workers' store seconds later)
    assert "restarting (1 of 3)" in err and re.search(r"finished after [12] restart\(s\)", err), err
    return out, project, err


def _resume_reference(tmp_path: Path, guard, project: Path, resumed: str, script: str, flags: list[str],
                      steps: int) -> Path:
    """The reference: the checkpoint the survivor resumed from, resumed by a one-machine launch of
    ``flags`` (the survivors' layout); returns its output folder."""
    reference_out, reference_project = tmp_path / "reference-out", tmp_path / "reference"
    reference_out.mkdir()
    shutil.copytree(project / "checkpoints" / resumed, reference_project / "checkpoints" / resumed)
    reference = _launch(tmp_path, guard, *flags, "--log_dir", str(tmp_path / "logs-ref"), str(SCRIPTS / script),
                        str(reference_out), str(reference_project), str(steps), "0")
    _, reference_err = reference.communicate(timeout=60)
    for ready in reference_out.glob("ready-*"):
        guard.track(int(ready.read_text()))
    assert reference.returncode == 0, reference_err
    return reference_out


def _bit_equal(left: dict, right: dict) -> bool:
    return left.keys() == right.keys() and all(torch.equal(left[k], right[k]) for k in left)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_killing_one_machine_leaves_the_other_training_from_the_last_commit(tmp_path, process_guard):
    out, project, _ = _kill_one_of_two_machines(tmp_path, process_guard, "elastic_train.py", ["--num_processes", "2"],
                                                STEPS, "0.3")
    resumed = (out / "resumed.txt").read_text()
    assert resumed.startswith("checkpoint_") and int(resumed.rpartition("_")[2]) >= KILL_AFTER - 1, resumed
    reference_out = _resume_reference(tmp_path, process_guard, project, resumed, "elastic_train.py",
                                      ["--num_processes", "1"], STEPS)
    assert (reference_out / "resumed.txt").read_text() == resumed
    assert _bit_equal(torch.load(out / "final.pt"), torch.load(reference_out / "final.pt"))


MESH_STEPS = 10  # optimizer steps of the tp x dp_shard run; checkpoint after each
SAMPLES_PER_RANK = 2  # the per-rank batch, kept when the data-parallel size changes


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_killing_one_machine_of_a_tp_mesh_shrinks_dp_shard_and_keeps_tp(tmp_path, process_guard):
    """tp 2 x dp_shard 2 on two machines of 2 ranks (fsdp strategy); one machine killed: the other
    re-derives dp_shard 1 from its world of 2 (tp stays 2), resumes from the last commit at the exact
    data position and ends with the parameters, bit for bit, of a tp 2 x dp_shard 1 launch resumed
    from the same checkpoint."""
    mesh = ["--strategy", "fsdp", "--tp_size", "2"]
    out, project, _ = _kill_one_of_two_machines(tmp_path, process_guard, "elastic_mesh_train.py",
                                                ["--num_processes", "4", *mesh, "--dp_shard_size", "2"],
                                                MESH_STEPS, "0.3", "4")
    run = json.loads((out / "run.json").read_text())
    assert (run["world"], run["mesh"]) == (2, {"dp_shard": 1, "tp": 2}), run
    resumed = run["resumed"]
    assert resumed.startswith("checkpoint_") and int(resumed.rpartition("_")[2]) >= KILL_AFTER - 1, run
    # every step before the kill ran on dp_shard 2: 2 ranks x 2 samples each; the survivor goes on from there
    assert run["first_sample"] == run["resumed_step"] * 2 * SAMPLES_PER_RANK > 0, run
    reference_out = _resume_reference(tmp_path, process_guard, project, resumed, "elastic_mesh_train.py",
                                      ["--num_processes", "2", *mesh], MESH_STEPS)
    reference = json.loads((reference_out / "run.json").read_text())
    assert reference == run, (reference, run)
    assert _bit_equal(torch.load(out / "final.pt"), torch.load(reference_out / "final.pt"))


GROW_STEPS = 400  # the first round (0.1 s a step) must still run when the second machine joins


@pytest.mark.multiprocess
@pytest.mark.timeout(150)
def test_a_joining_machine_is_taken_in_at_the_next_checkpoint_commit(tmp_path, process_guard):
    """One machine trains alone (``--num_machines 1:2``); a second one starts and waits to join. The
    first keeps training until its ranks commit the next checkpoint (torch elastic would restart them
    at once), then both resume from that commit in a world of 2 — a grown round, not a failure."""
    out, project = tmp_path / "out", tmp_path / "project"
    out.mkdir()
    common = ["--num_machines", "1:2", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", str(free_port()), "--max_restarts", "1", "--monitor_interval", "0.2",
              "--rdzv_conf", "last_call_timeout=1"]
    arguments = [str(SCRIPTS / "elastic_grow_train.py"), str(out), str(project), str(GROW_STEPS)]
    first_err = tmp_path / "machine0.err"
    with first_err.open("w") as err_file:
        first = _launch(tmp_path, process_guard, *common, "--machine_rank", "0", "--log_dir", str(tmp_path / "logs0"),
                        *arguments, stderr=err_file)
    deadline = time.monotonic() + 60
    while _committed(project) != ["checkpoint_0"]:
        assert first.poll() is None, first_err.read_text()
        assert time.monotonic() < deadline, "machine 0 never committed its first checkpoint alone"
        time.sleep(0.05)
    second = _launch(tmp_path, process_guard, *common, "--machine_rank", "1", "--log_dir", str(tmp_path / "logs1"),
                     *arguments)
    while "waiting to join" not in first_err.read_text():
        assert first.poll() is None and second.poll() is None, (first_err.read_text(), second.communicate())
        assert time.monotonic() < deadline + 30, "machine 0 never saw machine 1 waiting"
        time.sleep(0.05)
    assert _committed(project) == ["checkpoint_0"]  # still the first round: it was not restarted at the join
    (out / "commit").touch()
    _, second_err = second.communicate(timeout=90)
    first.communicate(timeout=30)
    for ready in out.glob("ready-*"):
        process_guard.track(int(ready.read_text()))
    err = first_err.read_text()
    assert first.returncode == 0 and second.returncode == 0, (err, second_err)
    assert "checkpoint" in err and "committed; restarting the workers into a round with the 1 waiting" in err, err
    assert "restarting (" not in err  # growing used none of --max_restarts
    run = json.loads((out / "run.json").read_text())
    assert run == {"world": 2, "resumed": "checkpoint_1", "step": GROW_STEPS}, run
