"""torchrig on a real one-node Slurm (Debian's slurm-wlm 22.05 + munge, started by the suite).

The session fixture (:mod:`slurm_cluster`) starts munged, slurmctld and slurmd from a temp
directory; without the packages, or when a daemon does not come up, every test here skips with
the reason. Each test submits real jobs (``srun``, ``sbatch``) and waits for their states with
hard timeouts; at the end every job is cancelled and no process of the cluster may survive.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest
from slurm_cluster import SlurmTestCluster, Unavailable

pytestmark = [pytest.mark.multiprocess]

TESTS = pathlib.Path(__file__).parent
WORKER = TESTS / "cluster_scripts" / "worker.py"
PREEMPTIBLE = TESTS / "preemption_scripts" / "preemptible_train.py"


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    cluster = SlurmTestCluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
    except Unavailable as exc:
        pytest.skip(f"no Slurm cluster: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()
        left = cluster.leftover_processes()
        assert not left, f"processes of the Slurm cluster left behind: {left}"


def worker_env(**extra: str) -> dict[str, str]:
    """What a job needs to find this checkout's torchrig, on top of the cluster's environment."""
    return {"PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


DETECT = ("import json, os, attrs; from torchrig.testing import make_host; host = make_host(); "
          "host.select_auto('cluster'); info = host.hook.torchrig_detect_cluster(environ=dict(os.environ)); "
          "print(json.dumps(attrs.asdict(info)))")


@pytest.mark.timeout(120)
def test_the_slurm_plugin_reads_the_variables_a_real_srun_sets(slurm: SlurmTestCluster, tmp_path):
    proc = slurm.run(["srun", "-J", "detect", "-n2", "--kill-on-bad-exit=1", sys.executable, "-c", DETECT],
                     env=worker_env(), cwd=str(tmp_path), timeout=90)
    infos = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                   key=lambda info: info["rank"])
    assert len(infos) == 2, proc.stdout + proc.stderr
    for rank, info in enumerate(infos):
        assert info["source"] == "slurm", info
        assert (info["rank"], info["local_rank"], info["world_size"], info["local_world_size"]) == (rank, rank, 2, 2)
        assert (info["node_rank"], info["num_nodes"]) == (0, 1), info
        assert info["master_addr"] == slurm.host, info
        assert 10000 <= info["master_port"] < 30000, info
    assert infos[0]["master_port"] == infos[1]["master_port"]
