"""Jobs nobody launched through torchrig: a Kubernetes PyTorchJob's variables, and a process group
the script (or Ray, or another framework) created itself before ``Accelerator()``.

Recorded environments go through the real hooks (``env`` and ``process_group`` cluster plugins);
the multi-process tests start real gloo processes on loopback: two started by the test with
exactly a PyTorchJob pod's variables (no launcher), two ``torchrun --nnodes 2`` agents (one per
"node"), and two scripts that call ``dist.init_process_group`` on a FileStore themselves.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time

import pytest
from torchrig.distributed.process_group import settle_threads
from torchrig.plugin.types import ClusterInfo
from torchrig.testing import make_host
from torchrig.testing.contracts import ClusterContract
from torchrig.testing.processes import spawn_in_new_session

WORKER = pathlib.Path(__file__).parent / "cluster_scripts" / "worker.py"
SHELL = {"HOME": "/root", "PATH": "/usr/local/bin:/usr/bin:/bin", "HOSTNAME": "train-worker-1"}

#: A pod of a 3-replica PyTorchJob (1 Master + 2 Workers) whose container runs `python train.py`:
#: the training operator sets these four (plus Kubernetes' own service variables).
PYTORCHJOB_WORKER_POD = SHELL | {
    "MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2",
    "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443", "PYTHONUNBUFFERED": "1",
}


def detect(environ, only=None):
    host = make_host()
    host.select_auto("cluster", only=only)
    return host.hook.torchrig_detect_cluster(environ=dict(environ))


class TestEnvClusterContract(ClusterContract):
    cluster = "env"
    priority = 20
    environments = (
        (PYTORCHJOB_WORKER_POD, {"rank": 2, "world_size": 3, "local_rank": 0, "local_world_size": 1, "node_rank": 2,
                                 "num_nodes": 3, "master_addr": "train-master-0", "master_port": 23456}),
        (PYTORCHJOB_WORKER_POD | {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RANK": "1", "WORLD_SIZE": "4"},
         {"rank": 1, "local_rank": 1, "local_world_size": 2, "node_rank": 0, "num_nodes": 2}),
        (SHELL, None),
        (SHELL | {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, None),  # no port: not the env:// contract
    )
    malformed = (
        (PYTORCHJOB_WORKER_POD | {"RANK": "two"}, "RANK='two'"),
        (PYTORCHJOB_WORKER_POD | {"RANK": "3"}, "RANK=3 is not below WORLD_SIZE=3"),
        (PYTORCHJOB_WORKER_POD | {"MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
        (PYTORCHJOB_WORKER_POD | {"MASTER_ADDR": " "}, "MASTER_ADDR"),
        (PYTORCHJOB_WORKER_POD | {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"),
    )


def test_a_pytorchjob_pod_running_the_script_directly_is_rank_of_world():
    assert detect(PYTORCHJOB_WORKER_POD) == ClusterInfo(
        rank=2, local_rank=0, world_size=3, local_world_size=1, node_rank=2, num_nodes=3,
        master_addr="train-master-0", master_port=23456, source="env")


def test_torchruns_full_set_stays_torchelastic():
    torchrun_worker = PYTORCHJOB_WORKER_POD | {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "2",
                                               "TORCHELASTIC_RUN_ID": "none"}
    assert detect(torchrun_worker).source == "torchelastic"
    assert detect(PYTORCHJOB_WORKER_POD, only="local") == ClusterInfo(source="local")  # the off switch


def test_process_group_plugin_declines_without_a_group():
    assert detect(SHELL, only="process_group") == ClusterInfo()  # declined: the core default answered
    assert detect(SHELL).source == "local"


# -- real processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_env() -> dict[str, str]:
    """The test's environment without any launcher or scheduler variable it may have inherited."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("TORCHRIG_", "SLURM_", "OMPI_", "PMI_", "PET_"))}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_all(commands: list[tuple[list[str], dict[str, str]]], guard, logs: pathlib.Path,
            timeout: float = 120) -> list[str]:
    """Run the commands together; each one's output goes to a file (a pipe read one process at a
    time could stall the other), and a failure or a timeout shows every process's log."""
    logs.mkdir(exist_ok=True)
    paths = [logs / f"process-{index}.log" for index in range(len(commands))]
    procs = []
    for (cmd, env), path in zip(commands, paths):
        with open(path, "w") as log:
            procs.append(spawn_in_new_session(cmd, guard=guard, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    try:
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        guard.kill_all()
    outputs = [path.read_text() for path in paths]
    report = "\n".join(f"--- {proc.args} exited {proc.returncode}:\n{output[-3000:]}"
                       for proc, output in zip(procs, outputs))
    assert time.monotonic() < deadline, f"still running after {timeout} s:\n{report}"
    assert all(proc.returncode == 0 for proc in procs), report
    return outputs


def results(out: pathlib.Path) -> list[dict]:
    return [json.loads((out / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


def assert_trained_together(ranks: list[dict], source: str) -> None:
    for rank, seen in enumerate(ranks):
        assert seen["rank"] == rank and seen["num_processes"] == 2 and seen["source"] == source, seen
        assert seen["distributed_type"] == "MULTI_CPU" and seen["reduced"] == 3.0, seen
    assert ranks[0]["weights"] == ranks[1]["weights"], "DDP must leave identical weights on both ranks"


def assert_group_released(ranks: list[dict]) -> None:
    """torchrig created the group: its exit handler destroys it (the script does not; the
    workers' exit status shows the exit did not abort, pytorch/pytorch#190489)."""
    for seen in ranks:
        assert seen["initialized_after_release"] is False, seen


@pytest.mark.timeout(180)
def test_pytorchjob_pods_run_the_script_directly(tmp_path, process_guard):
    port = free_port()
    pods = []
    for rank in (0, 1):  # exactly what the training operator sets; no LOCAL_RANK, no launcher
        pod = base_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank)}
        pods.append(([sys.executable, str(WORKER), "plain", str(tmp_path)], pod))
    run_all(pods, process_guard, tmp_path / "logs")
    ranks = results(tmp_path)
    assert_trained_together(ranks, "env")
    assert_group_released(ranks)
    assert all(seen["local_rank"] == 0 and seen["environ"]["LOCAL_RANK"] is None for seen in ranks), ranks


@pytest.mark.timeout(180)
def test_pytorchjob_pods_run_torchrun_with_two_nodes(tmp_path, process_guard):
    port = free_port()
    nodes = []
    for rank in (0, 1):  # the pod's variables, and the container command of the documented manifest
        pod = base_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank)}
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", pod["WORLD_SIZE"], "--nproc_per_node",
                   "1", "--node_rank", pod["RANK"], "--master_addr", pod["MASTER_ADDR"], "--master_port",
                   pod["MASTER_PORT"], "--max_restarts", "0", str(WORKER), "plain", str(tmp_path)]
        nodes.append((command, pod))
    run_all(nodes, process_guard, tmp_path / "logs")
    ranks = results(tmp_path)
    assert_trained_together(ranks, "torchelastic")
    assert_group_released(ranks)
    assert all(seen["environ"]["TORCHELASTIC_RUN_ID"] for seen in ranks), ranks


@pytest.mark.timeout(180)
def test_a_process_group_the_script_created_is_adopted_and_mismatches_are_refused(tmp_path, process_guard):
    store = tmp_path / "store"
    env = base_env()  # no RANK/WORLD_SIZE/MASTER_*: only the group says where each process sits
    scripts = [([sys.executable, str(WORKER), "adopt", str(tmp_path), str(store), str(rank), "2"], env) for rank in (0, 1)]
    run_all(scripts, process_guard, tmp_path / "logs")
    ranks = results(tmp_path)
    assert_trained_together(ranks, "process_group")
    for seen in ranks:
        # adopted, not re-created: torchrig never called init_process_group and kept the script's group
        assert seen["init_calls"] == 0 and seen["same_group"] and seen["adopted_group"], seen
        assert seen["adopted_backend"] == "gloo" and seen["local_rank"] == seen["rank"], seen
        assert "num_processes=3 (environment" in seen["num_processes_mismatch"], seen
        assert "existing process group has world size 2" in seen["num_processes_mismatch"], seen
        assert "init_process_group_kwargs.backend='nccl'" in seen["backend_mismatch"], seen
        assert "existing process group's backend is 'gloo'" in seen["backend_mismatch"], seen


def test_exit_handler_waits_while_another_thread_is_runnable():
    """``settle_threads`` (run at exit after the group is destroyed) releases the GIL until the
    process's other threads stop running: a gloo worker freeing a finished collective's tensors
    must get the GIL before finalization (pytorch/pytorch#190489)."""
    done = threading.Event()

    def spin(until: float) -> None:  # runnable the whole time, as a worker thread waiting for a CPU is
        while time.monotonic() < until:
            pass
        done.set()

    spinner = threading.Thread(target=spin, args=(time.monotonic() + 0.3,))
    spinner.start()
    settle_threads(limit_s=30)
    assert done.is_set(), "settle_threads returned while another thread was still runnable"
    spinner.join()
