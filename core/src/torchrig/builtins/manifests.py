"""Manifests of the built-in plugins. Torch-free: loaded for ``torchrig --help`` and listing."""

from __future__ import annotations

from torchrig.builtins.clusters.handoff_options import MPIOptions, SlurmOptions
from torchrig.builtins.device_presence import cuda_absence, mps_absence
from torchrig.plugin.hookspecs import HOOK_API_VERSION
from torchrig.plugin.manifest import PluginManifest
from torchrig.plugin.types import ConfigSection


class SINGLE(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "one process on one device, no distribution"
    install_hint = "torchrig"
    aliases = ("NO",)
    distributed_type = "NO"


class _Precision(PluginManifest):
    api_version = HOOK_API_VERSION
    install_hint = "torchrig"


class PRECISION_NO(_Precision):
    summary = "full fp32 precision"
    precision_type = "no"


class PRECISION_FP16(_Precision):
    summary = "float16 autocast with a dynamic GradScaler"
    precision_type = "fp16"


class PRECISION_BF16(_Precision):
    summary = "bfloat16 autocast"
    precision_type = "bf16"


class _Device(PluginManifest):
    api_version = HOOK_API_VERSION
    install_hint = "torchrig"


class DEVICE_CPU(_Device):
    summary = "the CPU (gloo process groups); the fallback when no accelerator is available"
    priority = 0
    distributed_device = "CPU"


class DEVICE_MPS(_Device):
    summary = "Apple Metal (MPS)"
    priority = 50

    def unavailable_reason(self) -> str | None:
        return mps_absence()


class DEVICE_CUDA(_Device):
    summary = "NVIDIA CUDA GPUs (nccl process groups), one per local rank"
    priority = 100
    distributed_device = "GPU"

    def unavailable_reason(self) -> str | None:
        return cuda_absence()


# Cluster environments, asked in descending priority (torchrig.builtins.clusters explains why):
# torchelastic 50 > slurm 40 > mpi 30 > env 20 > process_group 10 > local -100 > the core default
# (one process); each one's runtime is its module in torchrig.builtins.clusters.


class _Cluster(PluginManifest):
    api_version = HOOK_API_VERSION
    install_hint = "torchrig"


class CLUSTER_TORCHELASTIC(_Cluster):
    summary = ("workers started by torch elastic (torchrun, torchrig launch): RANK, WORLD_SIZE, MASTER_ADDR...; "
               "priority 50, asked first: its workers inherit the SLURM_*/OMPI_* of the agent that started them")
    priority = 50


class CLUSTER_SLURM(_Cluster):
    summary = ("one process per srun task: SLURM_PROCID, SLURM_NTASKS...; master = MASTER_ADDR or the step's first "
               "node, port = MASTER_PORT or 10000 + SLURM_JOB_ID % 20000; priority 40, after torchelastic, before mpi; "
               "declines in the batch script, an salloc/interactive shell and under mpirun; torchrig launch hands off "
               "to srun inside an allocation and submits with sbatch under `cluster: slurm` outside one")
    priority = 40
    config_section = ConfigSection("slurm", SlurmOptions, help="SlurmOptions (torchrig launch --cluster slurm: the "
                                   "sbatch job; inside an allocation: srun)")


class CLUSTER_MPI(_Cluster):
    summary = ("one process per MPI rank (Open MPI OMPI_COMM_WORLD_*, MVAPICH2 MV2_*, MPICH/Intel MPI PMI_RANK); "
               "MASTER_ADDR and MASTER_PORT exported with mpirun -x; priority 30, after torchelastic and slurm; "
               "torchrig launch --cluster mpi hands off to mpirun")
    priority = 30
    config_section = ConfigSection("mpi", MPIOptions, help="MPIOptions (torchrig launch --cluster mpi: mpirun)")


class CLUSTER_ENV(_Cluster):
    summary = ("torch's env:// variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT with no launcher (a Kubeflow "
               "PyTorchJob pod running the script); LOCAL_RANK optional (else one process per node); priority 20")
    priority = 20


class CLUSTER_PROCESS_GROUP(_Cluster):
    summary = ("a default process group created before torchrig (the user, another framework) that no variables "
               "describe: rank and world size from the group; priority 10, the last real environment")
    priority = 10


class CLUSTER_LOCAL(_Cluster):
    summary = ("one process, rank 0 of 1, ignoring leftover RANK/WORLD_SIZE/SLURM_* variables: select it with "
               "`cluster: local`; priority -100, below every real environment, so auto-detection never picks it over one")
    priority = -100
