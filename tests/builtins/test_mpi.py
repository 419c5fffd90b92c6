"""``torchrig launch --cluster mpi`` hands the ranks to a real Open MPI ``mpirun`` (Debian's
openmpi-bin); skipped with the reason when ``mpirun`` is not installed. The printed line
(``--dry-run``) is checked in tests/launch/test_handoff.py."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest
from torchrig.testing.processes import spawn_in_new_session

pytestmark = [pytest.mark.multiprocess]

WORKER = pathlib.Path(__file__).parent / "cluster_scripts" / "worker.py"


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed (Debian package openmpi-bin)")
def test_launch_cluster_mpi_trains_two_ranks_started_by_mpirun(tmp_path, process_guard):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI_", "TORCHRIG_"))}
    env |= {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1",
            # Open MPI refuses to run as root without both; --oversubscribe: 2 ranks may exceed the cores
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "TORCHRIG_MPI__MPIRUN_ARGS": "--oversubscribe"}
    log = tmp_path / "launch.log"
    with open(log, "w") as handle:
        proc = spawn_in_new_session(
            [sys.executable, "-m", "torchrig.launch", "--cluster", "mpi", "--num_processes", "2", "--log_dir",
             str(tmp_path / "logs"), str(WORKER), "plain", str(tmp_path)],
            guard=process_guard, env=env, cwd=str(tmp_path), stdout=handle, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 150
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    output = log.read_text()
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{output[-4000:]}"
    assert "handing off to mpirun: mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=" in output, output
    status = json.loads((tmp_path / "logs" / "run_status.json").read_text())
    assert (status["state"], status["exit_code"], status["plan"]["handed_off_to"]) == ("finished", 0, "mpirun"), status
    ranks = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, seen in enumerate(ranks):
        assert seen["rank"] == rank and seen["num_processes"] == 2 and seen["source"] == "mpi", seen
        assert seen["distributed_type"] == "MULTI_CPU" and seen["reduced"] == 3.0, seen
        assert seen["environ"]["TORCHELASTIC_RUN_ID"] is None, seen
    assert ranks[0]["weights"] == ranks[1]["weights"], "DDP must leave identical weights on both ranks"
