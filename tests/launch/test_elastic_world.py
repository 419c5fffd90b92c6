"""Elastic world size (issue 38): ``torchrig launch --num_machines MIN:MAX``.

The flag's parsing and its refusals (exit 2, naming the flag); the c10d rendezvous it configures
really closes a round with fewer machines than MAX (a real round on loopback); and the done-when:
two launchers ("machines") on loopback, one killed with ``kill -9`` on its process group mid-run,
the other goes on alone from the last commit and ends with the parameters of a reference run
resumed on one rank from that same checkpoint.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
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


def _launch(tmp_path: Path, guard, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torchrig", "launch", "--cpu", *args], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    guard.track(proc)
    return proc


def _committed(project: Path) -> list[str]:
    folder = project / "checkpoints"
    return sorted(p.name for p in folder.glob("checkpoint_*")) if folder.is_dir() else []


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_killing_one_machine_leaves_the_other_training_from_the_last_commit(tmp_path, process_guard):
    out, project = tmp_path / "out", tmp_path / "project"
    out.mkdir()
    port = free_port()
    common = ["--num_machines", "1:2", "--num_processes", "2", "--main_process_ip", "127.0.0.1",
              "--main_process_port", str(port), "--max_restarts", "2",
              "--rdzv_conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"]
    script = [str(SCRIPTS / "elastic_train.py"), str(out), str(project), str(STEPS), "0.3"]
    survivor, victim = (_launch(tmp_path, process_guard, *common, "--machine_rank", str(machine),
                                "--log_dir", str(tmp_path / f"logs{machine}"), *script) for machine in (0, 1))
    deadline = time.monotonic() + 60
    while len(_committed(project)) < KILL_AFTER:
        assert survivor.poll() is None and victim.poll() is None, (survivor.communicate(), victim.communicate())
        assert time.monotonic() < deadline, "the two machines never committed their checkpoints"
        time.sleep(0.05)
    os.killpg(victim.pid, signal.SIGKILL)
    victim.communicate(timeout=30)
    _, err = survivor.communicate(timeout=90)
    for ready in out.glob("ready-*"):
        process_guard.track(int(ready.read_text()))
    assert survivor.returncode == 0, err
    assert "restarting (1 of 2)" in err and "finished after 1 restart(s)" in err
    resumed = (out / "resumed.txt").read_text()
    assert resumed.startswith("checkpoint_") and int(resumed.rpartition("_")[2]) >= KILL_AFTER - 1, resumed
    elastic = torch.load(out / "final.pt")

    # the reference: the same checkpoint, resumed by a one-machine, one-rank launch
    reference_out, reference_project = tmp_path / "reference-out", tmp_path / "reference"
    reference_out.mkdir()
    shutil.copytree(project / "checkpoints" / resumed, reference_project / "checkpoints" / resumed)
    reference = _launch(tmp_path, process_guard, "--num_processes", "1", "--log_dir", str(tmp_path / "logs-ref"),
                        str(SCRIPTS / "elastic_train.py"), str(reference_out), str(reference_project),
                        str(STEPS), "0")
    _, reference_err = reference.communicate(timeout=60)
    assert reference.returncode == 0, reference_err
    assert (reference_out / "resumed.txt").read_text() == resumed
    expected = torch.load(reference_out / "final.pt")
    assert elastic.keys() == expected.keys()
    assert all(torch.equal(elastic[k], expected[k]) for k in elastic)
