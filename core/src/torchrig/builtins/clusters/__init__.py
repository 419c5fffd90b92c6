"""Built-in cluster environments, one module per environment: where a process sits in the job, read from
its environment — and, for Slurm and MPI, how ``torchrig launch`` hands the ranks to their launcher.

``torchrig_detect_cluster`` is a firstresult hook asked of the cluster plugins in descending
priority; a plugin answers only when it recognises the environment, otherwise it returns
``None`` and the next one is asked. Setting the ``cluster`` option (``cluster: slurm``) registers
only that plugin: the explicit override, and the off switch for auto-detection.

========  =============  ==============================================  ==============================================
priority  plugin         recognises                                      declines (returns ``None``) when
========  =============  ==============================================  ==============================================
50        torchelastic   ``RANK LOCAL_RANK WORLD_SIZE``                  one of its variables is missing
                         ``MASTER_ADDR MASTER_PORT`` (torchrun,
                         ``torchrig launch``)
40        slurm          an ``srun`` task: ``SLURM_JOB_ID``,             torch elastic started the workers (its variables
                         ``SLURM_PROCID`` and a regular                  and ``TORCHELASTIC_RUN_ID``); the batch script or
                         ``SLURM_STEP_ID``                               an ``salloc`` shell (no step, or the batch,
                                                                         interactive or extern step); ``SLURM_JOB_NAME``
                                                                         is ``bash`` or ``interactive``; an MPI
                                                                         launcher's rank disagrees with ``SLURM_PROCID``
30        mpi            ``OMPI_COMM_WORLD_*`` (Open MPI),               no MPI rank variable; raises ``ValueError`` when
                         ``MV2_COMM_WORLD_*`` (MVAPICH2),                ``MASTER_ADDR``/``MASTER_PORT`` are not exported
                         ``PMI_RANK PMI_SIZE`` (MPICH, Intel MPI)
20        env            torch's ``env://`` contract: ``RANK``,          one of the four is missing (``LOCAL_RANK`` is
                         ``WORLD_SIZE``, ``MASTER_ADDR``,                optional): a Kubeflow PyTorchJob or a JobSet
                         ``MASTER_PORT`` (no launcher)                   running the script directly sets exactly these
10        process_group  a default process group of several ranks that   ``torch.distributed`` is not imported, no default
                         already exists (created by the user, Ray,       group is initialised, or it has one rank (that
                         another framework)                              says nothing the default doesn't)
-100      local          always: one process, rank 0 of 1                never
trylast   core default   always: one process, rank 0 of 1                never
========  =============  ==============================================  ==============================================

Why this order:

* **torchelastic first.** When ``torchrun`` / ``torchrig launch`` runs inside an ``srun`` task
  (one agent per node) or under ``mpirun``, the workers inherit the launcher's ``SLURM_*`` /
  ``OMPI_*`` variables, which describe the *agent* (``SLURM_PROCID`` is the node's index,
  ``SLURM_NTASKS`` the number of nodes); only elastic's variables describe the worker. The slurm
  plugin also declines on its own when elastic's variables and ``TORCHELASTIC_RUN_ID`` are present,
  so ``cluster: slurm`` cannot misread such a worker either.
* **slurm before mpi.** ``srun --mpi=pmi2`` starts each rank itself and sets ``PMI_RANK``/``PMI_SIZE``
  equal to ``SLURM_PROCID``/``SLURM_NTASKS``: Slurm describes that process completely (the
  rendezvous comes from the node list), while MPI alone would demand ``MASTER_ADDR``. Conversely,
  under ``mpirun`` inside an allocation Slurm started only the MPI daemons (one task per node), so
  the MPI rank disagrees with ``SLURM_PROCID``/``SLURM_NTASKS`` and slurm declines: mpi answers.
* **env and process_group after them**: a pod that sets only ``RANK``/``WORLD_SIZE``/``MASTER_*``
  is env's; a group nobody describes is process_group's, last among the real environments.
* **local last**, below every real environment: it never wins auto-detection over them. Its
  purpose is the explicit ``cluster: local``, which registers it alone so that leftover
  ``RANK``/``WORLD_SIZE``/``SLURM_*`` variables are ignored and the script runs as one process.
  In auto-detection it is asked only after every real environment declined, and then answers
  exactly what the core default would (rank 0 of 1), with ``source="local"``.

The modules (Lightning Fabric's ``plugins/environments/`` layout): :mod:`.cluster_environment` (what
they share: reading integers, ports and rank/size pairs, each malformed value a ``ValueError`` naming
the variable), :mod:`.torchelastic`, :mod:`.slurm` (with :mod:`.slurm_hostlist`, Slurm's host list
and tasks-per-node syntaxes), :mod:`.mpi`, :mod:`.env`, :mod:`.process_group`, :mod:`.local`, and
:mod:`.handoff_options` (the ``slurm`` and ``mpi`` configuration sections).

**Why Slurm's and MPI's launcher hooks live here, not in the launch package.** Everything Slurm-specific
in the core is :mod:`.slurm` (detection, the ``srun``/``sbatch`` lines, submitting the job), everything
MPI-specific :mod:`.mpi`; :mod:`torchrig.launch.handoff` keeps only what any cluster's launcher needs
(run it in the foreground, forward signals, write ``run_status.json``, refuse a value with exit code 2),
which these two modules call. The layers contract (pyproject.toml) therefore puts :mod:`.slurm` and
:mod:`.mpi` just above ``launch``: a cluster plugin with a launch hook is a client of the launcher, as a
third-party plugin would be, and nothing in the core imports them (their entry points do). What the
core does import sits low: :mod:`.process_group` (``distributed.process_group`` asks it whether a group
exists) and :mod:`.handoff_options` (the torch-free manifests declare its sections). So this package's
modules sit at different heights, and this ``__init__`` imports none of them when it is imported: an
``import`` of them here would put the package in one layer (import-linter refuses a layer that contains
others). The 0.1 names of ``torchrig.builtins.clusters`` (then one module) resolve lazily for one release,
with a ``DeprecationWarning`` naming their new module (:data:`MOVED_NAMES`); nothing in the repository
uses them (tests/compat/test_cluster_moved_names.py), so import-linter still sees every real dependency.
docs/changelog.md lists where each name of the 0.1 modules ``torchrig.builtins.clusters``,
``torchrig.builtins.adopted`` and ``torchrig.builtins.handoff`` lives now. Nothing here imports torch.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_TORCHELASTIC = "torchrig.builtins.clusters.torchelastic"
_SLURM = "torchrig.builtins.clusters.slurm"
_HOSTLIST = "torchrig.builtins.clusters.slurm_hostlist"
_MPI = "torchrig.builtins.clusters.mpi"

#: 0.1 name of ``torchrig.builtins.clusters`` -> the module that holds it since 0.2. Goes in 0.3.
MOVED_NAMES: dict[str, str] = {
    "ELASTIC_RUN_ID": _TORCHELASTIC,
    "ELASTIC_VARIABLES": _TORCHELASTIC,
    "TorchElasticCluster": _TORCHELASTIC,
    "started_by_elastic": _TORCHELASTIC,
    "SLURM_INTERACTIVE_JOB_NAMES": _SLURM,
    "SlurmCluster": _SLURM,
    "detect_slurm": _SLURM,
    "slurm_launch_mode": _SLURM,
    "slurm_master_port": _SLURM,
    "slurm_task_recognised": _SLURM,
    "srun_command": _SLURM,
    "expand_hostlist": _HOSTLIST,
    "iter_hostlist": _HOSTLIST,
    "parse_tasks_per_node": _HOSTLIST,
    "MPICluster": _MPI,
    "detect_mpi": _MPI,
    "mpi_hands_off": _MPI,
    "mpirun_command": _MPI,
    "LocalCluster": "torchrig.builtins.clusters.local",
}


def __getattr__(name: str) -> Any:
    """A 0.1 name, from its new module, with a warning each time (nothing is cached here, so every use is seen)."""
    module = MOVED_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'torchrig.builtins.clusters' has no attribute {name!r}: it is a package of one "
                             "module per environment (torchelastic, slurm, slurm_hostlist, mpi, env, process_group, "
                             "local, handoff_options, cluster_environment); import the name from its module")
    warnings.warn(f"torchrig.builtins.clusters.{name} moved to {module}.{name}; the old name goes in torchrig 0.3 "
                  "(docs/changelog.md)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)
