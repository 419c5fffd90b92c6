"""Cluster-environment plugins: recorded environments → exact ClusterInfo through the real hook.

The environments below are what a process of each kind of job sees (trimmed to the variables
that matter plus typical noise). Detection goes through the installed entry points and pluggy,
exactly as :func:`torchrig.host.runtime.detect_cluster` does it.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import attrs
import pytest
from torchrig.builtins.clusters.mpi import mpi_hands_off, mpirun_command
from torchrig.builtins.clusters.slurm import slurm_launch_mode, slurm_master_port, srun_command
from torchrig.builtins.clusters.slurm_hostlist import expand_hostlist, parse_tasks_per_node
from torchrig.host.plugin_host import PluginStatus
from torchrig.plugin.types import ClusterInfo, LaunchPlan
from torchrig.testing import make_host

SHELL = {"HOME": "/home/ada", "PATH": "/opt/venv/bin:/usr/bin:/bin", "USER": "ada", "LANG": "C.UTF-8"}

#: `sbatch -N2 --ntasks-per-node=4 -J train job.sh`, job.sh: `srun python -u train.py`; task 5.
SLURM_SBATCH_SRUN_TASK5 = {
    **SHELL,
    "SLURM_CLUSTER_NAME": "hpc",
    "SLURM_SUBMIT_DIR": "/home/ada/run",
    "SLURM_SUBMIT_HOST": "login01",
    "SLURM_JOB_ID": "4242117",
    "SLURM_JOBID": "4242117",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_PARTITION": "gpu",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_CPUS_PER_NODE": "32(x2)",
    "SLURM_NODELIST": "gpu[07-08]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "8",
    "SLURM_NPROCS": "8",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_CPUS_ON_NODE": "32",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_LAUNCHER_PORT": "43117",
    "SLURM_SRUN_COMM_HOST": "10.1.0.7",
    "SLURM_LAUNCH_NODE_IPADDR": "10.1.0.7",
    "SLURM_DISTRIBUTION": "block",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_GTIDS": "4,5,6,7",
    "SLURM_TASK_PID": "81234",
    "SLURMD_NODENAME": "gpu08",
    "SLURM_TOPOLOGY_ADDR": "gpu08",
    "SLURM_PRIO_PROCESS": "0",
    "SLURM_UMASK": "0022",
}

#: The batch script of the same job, running `python train.py` itself (no srun): the batch step
#: has task variables of its own, but no step id and no step node list.
SLURM_BATCH_SCRIPT = {
    k: v for k, v in SLURM_SBATCH_SRUN_TASK5.items()
    if not k.startswith("SLURM_STEP") and k not in ("SLURM_SRUN_COMM_HOST", "SLURM_LAUNCH_NODE_IPADDR",
                                                    "SLURM_DISTRIBUTION", "SLURM_GTIDS")
} | {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURMD_NODENAME": "gpu07", "SLURM_GTIDS": "0"}

#: `salloc -N2 --ntasks-per-node=4`: the shell on the login node; python started from it.
SLURM_SALLOC_SHELL = {
    **SHELL,
    "SLURM_CLUSTER_NAME": "hpc",
    "SLURM_JOB_ID": "4242200",
    "SLURM_JOBID": "4242200",
    "SLURM_JOB_NAME": "interactive",
    "SLURM_JOB_NODELIST": "cn[101-102]",
    "SLURM_NODELIST": "cn[101-102]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "8",
    "SLURM_NPROCS": "8",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_CPUS_PER_NODE": "16(x2)",
    "SLURM_SUBMIT_DIR": "/home/ada",
    "SLURM_SUBMIT_HOST": "login01",
}

#: `srun -N1 --pty bash` (job name "bash"): the interactive shell is itself task 0 of step 0.
SLURM_SRUN_PTY_BASH = {
    **SHELL,
    "SLURM_JOB_ID": "4242300",
    "SLURM_JOB_NAME": "bash",
    "SLURM_JOB_NODELIST": "cn103",
    "SLURM_NNODES": "1",
    "SLURM_NTASKS": "1",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "cn103",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_STEP_TASKS_PER_NODE": "1",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_PTY_PORT": "40211",
}

#: job.sh: `srun --ntasks-per-node=1 torchrun --nnodes=2 --nproc-per-node=4 --rdzv-endpoint=gpu07:29500
#: train.py`: worker 6 (local 2) on the second node. It inherits the srun task of its agent
#: (SLURM_PROCID=1 of SLURM_NTASKS=2, the node's index) and gets elastic's variables.
TORCHRUN_IN_SLURM_WORKER6 = {
    **{k: v for k, v in SLURM_SBATCH_SRUN_TASK5.items() if k not in ("SLURM_GTIDS",)},
    "SLURM_NTASKS": "2",
    "SLURM_NPROCS": "2",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_GTIDS": "1",
    "RANK": "6",
    "LOCAL_RANK": "2",
    "WORLD_SIZE": "8",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "6",
    "ROLE_WORLD_SIZE": "8",
    "ROLE_NAME": "default",
    "MASTER_ADDR": "gpu07",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "4242117",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "False",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "OMP_NUM_THREADS": "1",
}

#: `torchrun --nproc-per-node=4 train.py` typed in the salloc shell (on the allocation's node).
TORCHRUN_IN_SALLOC_WORKER3 = {
    **SLURM_SALLOC_SHELL,
    "RANK": "3",
    "LOCAL_RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0",
}

#: `mpirun -np 4 -H n1:2,n2:2 -x MASTER_ADDR=n1 -x MASTER_PORT=29500 -x PATH python -u train.py`,
#: rank 2 = first rank of the second node. OMPI_COMM_WORLD_NODE_RANK is a rank *within* the node.
OPENMPI_2X2_RANK2 = {
    **SHELL,
    "OMPI_COMM_WORLD_RANK": "2",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "0",
    "OMPI_UNIVERSE_SIZE": "4",
    "OMPI_APP_CTX_NUM_PROCS": "4",
    "OMPI_FIRST_RANKS": "0",
    "OMPI_MCA_orte_hnp_uri": "1780875264.0;tcp://10.0.0.1:41233",
    "OMPI_MCA_ess": "^singleton",
    "OMPI_MCA_orte_ess_num_procs": "4",
    "OMPI_FILE_LOCATION": "/tmp/ompi.n2.1000/pid.5120/0/2",
    "PMIX_RANK": "2",
    "PMIX_NAMESPACE": "1780875265",
    "PMIX_SERVER_URI21": "1780875264.1;tcp4://127.0.0.1:51011",
    "MASTER_ADDR": "n1",
    "MASTER_PORT": "29500",
}
OPENMPI_2X2_RANK3 = OPENMPI_2X2_RANK2 | {
    "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_NODE_RANK": "1",
    "PMIX_RANK": "3", "OMPI_FILE_LOCATION": "/tmp/ompi.n2.1000/pid.5120/0/3",
}

#: The same mpirun inside an sbatch allocation: Open MPI started its daemons with
#: `srun --ntasks-per-node=1 orted` (a 2-task step), whose task variables every rank inherits.
OPENMPI_IN_SLURM_RANK3 = OPENMPI_2X2_RANK3 | {
    "SLURM_JOB_ID": "4242400",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
}

#: `mpiexec.hydra -n 8 -ppn 4 -hosts node-a,node-b -genv MASTER_ADDR node-a -genv MASTER_PORT 29400
#: python -u train.py` (Intel MPI 2021), rank 6.
INTEL_MPI_RANK6 = {
    **SHELL,
    "I_MPI_ROOT": "/opt/intel/oneapi/mpi/2021.10.0",
    "I_MPI_HYDRA_TOPOLIB": "hwloc",
    "I_MPI_PIN_MAPPING": "4:0 0,1 14,2 28,3 42",
    "PMI_RANK": "6",
    "PMI_SIZE": "8",
    "PMI_FD": "9",
    "MPI_LOCALRANKID": "2",
    "MPI_LOCALNRANKS": "4",
    "MPIR_CVAR_CH3_INTERFACE_HOSTNAME": "node-b",
    "MASTER_ADDR": "node-a",
    "MASTER_PORT": "29400",
}

#: `srun -N2 --ntasks-per-node=2 --mpi=pmi2 python -u train.py`: Slurm's PMI2 plugin sets
#: PMI_RANK/PMI_SIZE equal to the task's own.
SRUN_PMI2_TASK3 = {
    **SHELL,
    "SLURM_JOB_ID": "4242500",
    "SLURM_JOB_NAME": "train",
    "SLURM_JOB_NODELIST": "cn[001-002]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_ID": "3",
    "SLURM_STEP_NODELIST": "cn[001-002]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "PMI_RANK": "3",
    "PMI_SIZE": "4",
    "PMI_FD": "7",
    "PMI_JOBID": "4242500.3",
}


@functools.cache
def cluster_host(only: str | None):
    """A host with the cluster plugins registered as ``detect_cluster`` does (all by priority, or
    only ``only``). Cached: discovery costs ~0.1 s and the cluster plugins keep no state."""
    host = make_host()
    host.select_auto("cluster", only=only)
    return host


def detect(env, only=None):
    return cluster_host(only).hook.torchrig_detect_cluster(environ=dict(env))


def is_one_process(info: ClusterInfo) -> bool:
    """Rank 0 of 1 with no rendezvous, answered by nobody but a single-process fallback: ``local``
    (lowest priority, asked after every real environment declined) or the core default."""
    return attrs.evolve(info, source="default") == ClusterInfo() and info.source in ("local", "default")


# -- priorities and registration --------------------------------------------------------------


def test_cluster_plugins_are_installed_with_their_documented_priorities():
    host = make_host()
    infos = {i.name: i for i in host.plugins("cluster")}
    assert {name: info.priority for name, info in infos.items() if info.record.distribution == "torchrig"} == {
        "torchelastic": 50, "slurm": 40, "mpi": 30, "env": 20, "process_group": 10, "local": -100,
    }
    for info in infos.values():
        assert info.status is PluginStatus.AVAILABLE
        assert info.manifest.summary
    host.select_auto("cluster")
    asked = [name for name, _ in host.iter_impls("torchrig_detect_cluster", environ={})]
    builtin = ["cluster:torchelastic", "cluster:slurm", "cluster:mpi", "cluster:env", "cluster:process_group",
               "cluster:local"]
    assert [n for n in asked if n in builtin] == builtin  # highest priority asked first
    assert asked[-1] == "core:defaults"


@pytest.mark.multiprocess
def test_cluster_modules_do_not_import_torch():
    modules = ", ".join(f"torchrig.builtins.clusters.{name}" for name in (
        "torchelastic", "slurm", "slurm_hostlist", "mpi", "env", "process_group", "local", "handoff_options"))
    code = f"import sys, {modules}, torchrig.builtins.manifests; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- auto-detection over recorded environments ------------------------------------------------


@pytest.mark.parametrize("env", [{}, SHELL], ids=["empty", "shell"])
def test_no_cluster_is_one_process(env):
    assert detect(env) == ClusterInfo(source="local")  # every real environment declined
    assert is_one_process(detect(env))


def test_sbatch_srun_task():
    assert detect(SLURM_SBATCH_SRUN_TASK5) == ClusterInfo(
        rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1, num_nodes=2,
        master_addr="gpu07", master_port=10000 + 4242117 % 20000, source="slurm",
    )
    assert slurm_master_port(4242117) == 12117


def test_every_task_of_the_step_agrees_on_the_rendezvous():
    infos = []
    for rank in range(8):
        env = SLURM_SBATCH_SRUN_TASK5 | {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 4),
                                         "SLURM_NODEID": str(rank // 4)}
        infos.append(detect(env))
    assert [i.rank for i in infos] == list(range(8))
    assert [i.node_rank for i in infos] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {(i.master_addr, i.master_port, i.world_size) for i in infos} == {("gpu07", 12117, 8)}


def test_slurm_prefers_exported_master_address_and_port():
    env = SLURM_SBATCH_SRUN_TASK5 | {"MASTER_ADDR": "10.1.0.7", "MASTER_PORT": "23456"}
    info = detect(env)
    assert (info.source, info.master_addr, info.master_port) == ("slurm", "10.1.0.7", 23456)


def test_slurm_uneven_tasks_per_node():
    # `srun -n11 -N3` over node[01-03,07]... the step runs 4, 4 and 3 tasks; task 10 is on the third node.
    env = SLURM_SBATCH_SRUN_TASK5 | {
        "SLURM_STEP_NODELIST": "node[01-03]", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NUM_TASKS": "11",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NNODES": "3", "SLURM_NTASKS": "11",
        "SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_PROCID": "10", "SLURM_LOCALID": "2", "SLURM_NODEID": "2",
    }
    info = detect(env)
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank, info.num_nodes,
            info.master_addr) == (10, 2, 11, 3, 2, 3, "node01")


def test_slurm_step_on_part_of_the_allocation_uses_the_step_not_the_job():
    # `srun -N1 -n2 -w gpu08` inside the 2-node allocation: the master is the step's node.
    env = SLURM_SBATCH_SRUN_TASK5 | {
        "SLURM_STEP_NODELIST": "gpu08", "SLURM_NODELIST": "gpu08", "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NTASKS": "2",
        "SLURM_TASKS_PER_NODE": "2", "SLURM_NTASKS_PER_NODE": "4", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
    }
    info = detect(env)
    assert (info.world_size, info.local_world_size, info.num_nodes, info.master_addr) == (2, 2, 1, "gpu08")


def test_single_task_step_has_no_rendezvous():
    env = SLURM_SRUN_PTY_BASH | {"SLURM_JOB_NAME": "debug"}
    assert detect(env) == ClusterInfo(source="slurm")


@pytest.mark.parametrize("env", [SLURM_BATCH_SCRIPT, SLURM_SALLOC_SHELL, SLURM_SRUN_PTY_BASH],
                         ids=["batch-script", "salloc-shell", "srun-pty-bash"])
def test_slurm_does_not_misfire_outside_an_srun_task(env):
    assert is_one_process(detect(env))
    assert detect(env, only="slurm") == ClusterInfo()  # the core default


@pytest.mark.parametrize("step", ["4294967291", "4294967292", "4294967290", "batch", "extern", "interactive"])
def test_special_slurm_steps_are_not_srun_tasks(step):
    assert detect(SLURM_SBATCH_SRUN_TASK5 | {"SLURM_STEP_ID": step}, only="slurm") == ClusterInfo()


@pytest.mark.parametrize("name", ["bash", "interactive"])
def test_interactive_job_names_are_not_detected(name):
    # Lightning's rule: python started from an interactive shell is not a training step's task.
    assert is_one_process(detect(SLURM_SBATCH_SRUN_TASK5 | {"SLURM_JOB_NAME": name}))


def test_torchrun_inside_slurm_is_torchelastic():
    assert detect(TORCHRUN_IN_SLURM_WORKER6) == ClusterInfo(
        rank=6, local_rank=2, world_size=8, local_world_size=4, node_rank=1, num_nodes=2,
        master_addr="gpu07", master_port=29500, source="torchelastic",
    )
    # slurm yields even when forced: its variables describe torchrun's agent, not this worker.
    assert detect(TORCHRUN_IN_SLURM_WORKER6, only="slurm") == ClusterInfo()


def test_torchrun_inside_salloc_is_torchelastic():
    info = detect(TORCHRUN_IN_SALLOC_WORKER3)
    assert (info.source, info.rank, info.world_size, info.master_addr) == ("torchelastic", 3, 4, "127.0.0.1")


def test_open_mpi_two_by_two():
    assert detect(OPENMPI_2X2_RANK2) == ClusterInfo(
        rank=2, local_rank=0, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
        master_addr="n1", master_port=29500, source="mpi",
    )
    info = detect(OPENMPI_2X2_RANK3)
    assert (info.rank, info.local_rank, info.node_rank, info.num_nodes) == (3, 1, 1, 2)


def test_mpirun_inside_slurm_is_mpi_not_slurm():
    info = detect(OPENMPI_IN_SLURM_RANK3)
    assert (info.source, info.rank, info.world_size, info.local_rank) == ("mpi", 3, 4, 1)
    # Slurm started orted (task 1 of 2), not this rank: forced slurm declines rather than misread.
    assert detect(OPENMPI_IN_SLURM_RANK3, only="slurm") == ClusterInfo()


def test_intel_mpi():
    assert detect(INTEL_MPI_RANK6) == ClusterInfo(
        rank=6, local_rank=2, world_size=8, local_world_size=4, node_rank=1, num_nodes=2,
        master_addr="node-a", master_port=29400, source="mpi",
    )


def test_srun_with_pmi2_is_slurm():
    assert detect(SRUN_PMI2_TASK3) == ClusterInfo(
        rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
        master_addr="cn001", master_port=10000 + 4242500 % 20000, source="slurm",
    )


def test_mvapich2():
    env = SHELL | {"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1",
                   "MV2_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h1", "MASTER_PORT": "1234"}
    info = detect(env)
    assert (info.source, info.rank, info.local_rank, info.num_nodes, info.node_rank) == ("mpi", 1, 1, 1, 0)


def test_mpi_without_master_address_says_what_to_export():
    env = {k: v for k, v in OPENMPI_2X2_RANK3.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    with pytest.raises(ValueError) as excinfo:
        detect(env)
    message = str(excinfo.value)
    assert "rank 3 of 4 started by Open MPI" in message
    assert "MASTER_ADDR and MASTER_PORT are not set" in message
    assert "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port>" in message

    with pytest.raises(ValueError, match=r"MASTER_PORT is not set.*mpiexec -genv MASTER_ADDR"):
        detect({k: v for k, v in INTEL_MPI_RANK6.items() if k != "MASTER_PORT"})


def test_single_mpi_rank_needs_no_rendezvous():
    env = SHELL | {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                   "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert detect(env) == ClusterInfo(source="mpi")


# -- the explicit override --------------------------------------------------------------------

LEFTOVERS = SHELL | {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "MASTER_ADDR": "gpu07", "MASTER_PORT": "29500"}


def test_cluster_local_ignores_leftover_rank_variables():
    assert detect(LEFTOVERS).world_size == 8  # auto-detection reads them (torchelastic)
    assert detect(LEFTOVERS, only="local") == ClusterInfo(source="local")
    assert detect(SLURM_SBATCH_SRUN_TASK5, only="local") == ClusterInfo(source="local")
    assert detect(OPENMPI_2X2_RANK2 | {"MASTER_ADDR": ""}, only="local") == ClusterInfo(source="local")


def test_local_never_wins_over_a_real_environment():
    for env in (SLURM_SBATCH_SRUN_TASK5, TORCHRUN_IN_SLURM_WORKER6, OPENMPI_2X2_RANK2, INTEL_MPI_RANK6):
        assert detect(env).source != "local"


def test_forcing_slurm_outside_slurm_is_the_core_default():
    assert detect({}, only="slurm") == ClusterInfo()
    assert detect(LEFTOVERS, only="slurm") == ClusterInfo()
    assert detect(OPENMPI_2X2_RANK2, only="slurm") == ClusterInfo()
    assert detect(SLURM_SBATCH_SRUN_TASK5, only="mpi") == ClusterInfo()


def test_runtime_detect_cluster_honours_the_cluster_option():
    from torchrig.host.runtime import detect_cluster

    assert detect_cluster(make_host(), {"cluster": "local"}, environ=LEFTOVERS).source == "local"
    assert detect_cluster(make_host(), {}, environ=SLURM_SBATCH_SRUN_TASK5).source == "slurm"


# -- malformed values -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "only", "variable"),
    [
        (SLURM_SBATCH_SRUN_TASK5 | {"SLURM_PROCID": "five"}, None, "SLURM_PROCID='five'"),
        (SLURM_SBATCH_SRUN_TASK5 | {"SLURM_STEP_NUM_TASKS": "0"}, None, "SLURM_STEP_NUM_TASKS='0'"),
        (SLURM_SBATCH_SRUN_TASK5 | {"SLURM_PROCID": "8"}, None, "SLURM_PROCID=8 is not below SLURM_STEP_NUM_TASKS=8"),
        (SLURM_SBATCH_SRUN_TASK5 | {"SLURM_LOCALID": "4"}, None, "SLURM_LOCALID=4 is not below SLURM_STEP_TASKS_PER_NODE=4"),
        (SLURM_SBATCH_SRUN_TASK5 | {"SLURM_NODEID": "x"}, None, "SLURM_NODEID='x'"),
        (SLURM_SBATCH_SRUN_TASK5 | {"SLURM_STEP_TASKS_PER_NODE": "4(x)"}, None, "SLURM_STEP_TASKS_PER_NODE='4(x)'"),
        (SLURM_SBATCH_SRUN_TASK5 | {"SLURM_STEP_NODELIST": "gpu[07-"}, None, "SLURM_STEP_NODELIST='gpu[07-'"),
        (SLURM_SBATCH_SRUN_TASK5 | {"SLURM_STEP_ID": "zero"}, None, "SLURM_STEP_ID='zero'"),
        (SLURM_SBATCH_SRUN_TASK5 | {"SLURM_JOB_ID": "abc", "SLURM_JOBID": "abc"}, None, "SLURM_JOB_ID='abc'"),
        (SLURM_SBATCH_SRUN_TASK5 | {"MASTER_PORT": "99999"}, None, "MASTER_PORT='99999'"),
        ({k: v for k, v in SLURM_SBATCH_SRUN_TASK5.items() if k != "SLURM_LOCALID"}, None, "SLURM_LOCALID is not set"),
        (OPENMPI_2X2_RANK2 | {"OMPI_COMM_WORLD_SIZE": ""}, None, "OMPI_COMM_WORLD_SIZE=''"),
        (OPENMPI_2X2_RANK2 | {"OMPI_COMM_WORLD_RANK": "4"}, None, "OMPI_COMM_WORLD_RANK=4 is not below OMPI_COMM_WORLD_SIZE=4"),
        (OPENMPI_2X2_RANK2 | {"MASTER_PORT": "port"}, None, "MASTER_PORT='port'"),
        ({k: v for k, v in INTEL_MPI_RANK6.items() if k != "MPI_LOCALRANKID"}, None, "MPI_LOCALRANKID is not"),
        (LEFTOVERS | {"RANK": "three"}, None, "RANK='three'"),
    ],
)
def test_malformed_values_name_the_variable(env, only, variable):
    with pytest.raises(ValueError) as excinfo:
        detect(env, only=only)
    assert variable in str(excinfo.value)


# -- host lists and tasks per node ------------------------------------------------------------


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node[01-03,07],gpu-a1", ["node01", "node02", "node03", "node07", "gpu-a1"]),
        ("gpu07", ["gpu07"]),
        ("a,b,c", ["a", "b", "c"]),
        ("node[8-10]", ["node8", "node9", "node10"]),
        ("node[08-10]", ["node08", "node09", "node10"]),
        ("node[098-101]", ["node098", "node099", "node100", "node101"]),
        ("cn[1-2]-ib[0-1]", ["cn1-ib0", "cn1-ib1", "cn2-ib0", "cn2-ib1"]),
        ("rack[1-2]n[01,03]x", ["rack1n01x", "rack1n03x", "rack2n01x", "rack2n03x"]),
        ("[1-2]", ["1", "2"]),
        ("n[5],m[1-2],k", ["n5", "m1", "m2", "k"]),
        ("gpu-a100-[001-002].cluster.local", ["gpu-a100-001.cluster.local", "gpu-a100-002.cluster.local"]),
    ],
)
def test_expand_hostlist(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["", "  ", "node[01-", "node]1", "node[]", "node[a-b]", "node[3-1]", "node[[1]]",
                                 "a,,b", "node[1-2-3]", "node[1:2]"])
def test_malformed_hostlists_raise(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_first_host_of_a_huge_hostlist_is_cheap():
    env = SLURM_SBATCH_SRUN_TASK5 | {"SLURM_STEP_NODELIST": "n[0000000-9999999]"}
    assert detect(env).master_addr == "n0000000"


@pytest.mark.parametrize(("value", "counts"), [("4", [4]), ("4(x2)", [4, 4]), ("4(x2),3", [4, 4, 3]),
                                               ("2,1(x3),8", [2, 1, 1, 1, 8])])
def test_parse_tasks_per_node(value, counts):
    assert parse_tasks_per_node(value) == counts


@pytest.mark.parametrize("bad", ["", "x", "4(x)", "4(2)", "4(x2", "4,,3"])
def test_malformed_tasks_per_node_raise(bad):
    with pytest.raises(ValueError):
        parse_tasks_per_node(bad)


# -- launch command lines ---------------------------------------------------------------------

WORKER = ["/opt/venv/bin/python", "-u", "train.py", "--lr", "0.1"]


def test_srun_command():
    assert srun_command(4, 2, WORKER) == [
        "srun", "--nodes=2", "--ntasks-per-node=4", "--ntasks=8", "--kill-on-bad-exit=1", *WORKER,
    ]
    assert srun_command(1, 3, WORKER, cpus_per_task=8, extra=["--gpus-per-task=1", "--label"]) == [
        "srun", "--nodes=3", "--ntasks-per-node=1", "--ntasks=3", "--cpus-per-task=8", "--kill-on-bad-exit=1",
        "--gpus-per-task=1", "--label", *WORKER,
    ]


@pytest.mark.parametrize("kwargs", [dict(nproc_per_node=0, num_nodes=1, command=WORKER),
                                    dict(nproc_per_node=2, num_nodes=True, command=WORKER),
                                    dict(nproc_per_node=2, num_nodes=1, command=[]),
                                    dict(nproc_per_node=2, num_nodes=1, command="python train.py"),
                                    dict(nproc_per_node=2, num_nodes=1, command=WORKER, cpus_per_task=0)])
def test_srun_command_rejects_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        srun_command(**kwargs)


def test_mpirun_command():
    assert mpirun_command(4, WORKER, hosts=["n1", "n2"], master_addr="n1", master_port=29500) == [
        "mpirun", "-np", "4", "-H", "n1:2,n2:2", "-x", "MASTER_ADDR=n1", "-x", "MASTER_PORT=29500", "-x", "PATH",
        *WORKER,
    ]
    assert mpirun_command(2, WORKER, master_addr="127.0.0.1", master_port=29501) == [
        "mpirun", "-np", "2", "-x", "MASTER_ADDR=127.0.0.1", "-x", "MASTER_PORT=29501", "-x", "PATH", *WORKER,
    ]
    assert mpirun_command(3, WORKER, hosts=["n1:2", "n2:1"], master_addr="n1", master_port=29500,
                          extra=["--bind-to", "none"])[3:5] == ["-H", "n1:2,n2:1"]
    assert mpirun_command(3, WORKER, hosts=["n1:2", "n2:1"], master_addr="n1", master_port=29500,
                          extra=["--bind-to", "none"])[-7:-5] == ["--bind-to", "none"]


@pytest.mark.parametrize("kwargs", [dict(nproc=0), dict(hosts=["n1", "n2", "n3"]), dict(hosts=["n1:1", "n2:1"]),
                                    dict(hosts=["n1:x"]), dict(master_addr=""), dict(master_port=70000),
                                    dict(command=[])])
def test_mpirun_command_rejects_bad_arguments(kwargs):
    arguments = dict(nproc=4, command=WORKER, master_addr="n1", master_port=29500) | kwargs
    with pytest.raises(ValueError):
        mpirun_command(arguments.pop("nproc"), arguments.pop("command"), **arguments)


# -- the cluster contract (torchrig.testing.contracts.ClusterContract) -------------------------

from torchrig.testing.contracts import ClusterContract  # noqa: E402


class TestTorchElasticContract(ClusterContract):
    cluster = "torchelastic"
    priority = 50
    environments = [
        (TORCHRUN_IN_SLURM_WORKER6, {"rank": 6, "local_rank": 2, "world_size": 8, "local_world_size": 4,
                                     "node_rank": 1, "num_nodes": 2, "master_addr": "gpu07", "master_port": 29500}),
        (TORCHRUN_IN_SALLOC_WORKER3, {"rank": 3, "world_size": 4, "master_addr": "127.0.0.1"}),
        (LEFTOVERS, {"rank": 3, "world_size": 8}),
        (SHELL, None),
        (SLURM_SBATCH_SRUN_TASK5, None),
    ]
    malformed = [(LEFTOVERS | {"RANK": "three"}, "RANK='three'")]


class TestSlurmContract(ClusterContract):
    cluster = "slurm"
    priority = 40
    environments = [
        (SLURM_SBATCH_SRUN_TASK5, {"rank": 5, "local_rank": 1, "world_size": 8, "local_world_size": 4, "node_rank": 1,
                                   "num_nodes": 2, "master_addr": "gpu07", "master_port": 12117}),
        (SRUN_PMI2_TASK3, {"rank": 3, "world_size": 4, "master_addr": "cn001"}),
        (SLURM_BATCH_SCRIPT, None),
        (SLURM_SALLOC_SHELL, None),
        (SLURM_SRUN_PTY_BASH, None),
        (TORCHRUN_IN_SLURM_WORKER6, None),
        (OPENMPI_IN_SLURM_RANK3, None),
    ]
    malformed = [(SLURM_SBATCH_SRUN_TASK5 | {"SLURM_PROCID": "five"}, "SLURM_PROCID='five'"),
                 ({k: v for k, v in SLURM_SBATCH_SRUN_TASK5.items() if k != "SLURM_LOCALID"}, "SLURM_LOCALID")]


class TestMPIContract(ClusterContract):
    cluster = "mpi"
    priority = 30
    environments = [
        (OPENMPI_2X2_RANK2, {"rank": 2, "local_rank": 0, "world_size": 4, "local_world_size": 2, "node_rank": 1,
                             "num_nodes": 2, "master_addr": "n1", "master_port": 29500}),
        (OPENMPI_IN_SLURM_RANK3, {"rank": 3, "world_size": 4, "local_rank": 1}),
        (INTEL_MPI_RANK6, {"rank": 6, "world_size": 8, "master_addr": "node-a", "master_port": 29400}),
        (SHELL, None),
    ]
    malformed = [(OPENMPI_2X2_RANK2 | {"OMPI_COMM_WORLD_RANK": "4"}, "OMPI_COMM_WORLD_RANK=4"),
                 ({k: v for k, v in OPENMPI_2X2_RANK3.items() if k not in ("MASTER_ADDR", "MASTER_PORT")},
                  "MASTER_ADDR")]


class TestLocalContract(ClusterContract):
    """``local`` answers everywhere (one process); auto-detection picks it only where no real
    environment is recognised."""

    cluster = "local"
    priority = -100
    environments = [(SHELL, {"rank": 0, "world_size": 1, "master_addr": None}), ({}, {"world_size": 1}),
                    (LEFTOVERS, {"rank": 0, "world_size": 1}), (SLURM_SBATCH_SRUN_TASK5, {"world_size": 1})]


# -- torchrig launch: does the slurm / mpi plugin take the launch? (recorded environments) ---------


@pytest.mark.parametrize(("environ", "cluster", "mode"), [
    (SHELL, None, None),                          # a workstation: torch elastic
    (SHELL, "slurm", "sbatch"),                   # a login node, --cluster slurm: submit
    (SLURM_BATCH_SCRIPT, None, "srun"),           # the batch script: one srun step over the allocation
    (SLURM_BATCH_SCRIPT, "slurm", "srun"),
    (SLURM_SALLOC_SHELL, None, "srun"),           # an salloc shell: the same
    (SLURM_SBATCH_SRUN_TASK5, None, None),        # srun torchrig launch: this launcher is the node's agent
    (SLURM_SRUN_PTY_BASH, None, None),            # srun --pty bash: a step holds the resources already
    (TORCHRUN_IN_SLURM_WORKER6, None, None),      # a torch elastic worker inside the allocation
    (OPENMPI_IN_SLURM_RANK3, None, None),         # an MPI rank inside the allocation (its own step)
])
def test_where_torchrig_launch_hands_off_to_slurm(environ, cluster, mode):
    assert slurm_launch_mode(LaunchPlan(command=["x"], cluster=cluster), environ) == mode


@pytest.mark.parametrize(("environ", "cluster", "hands_off"), [
    (SHELL, "mpi", True), (SHELL, None, False), (SHELL, "slurm", False),
    (OPENMPI_2X2_RANK2, "mpi", False),            # mpirun torchrig launch: already an MPI rank
    (INTEL_MPI_RANK6, "mpi", False),
])
def test_where_torchrig_launch_hands_off_to_mpirun(environ, cluster, hands_off):
    assert mpi_hands_off(LaunchPlan(command=["x"], cluster=cluster), environ) is hands_off
