"""Cluster environments that nobody launched through torchrig or torch elastic.

Two built-in cluster plugins, asked after torchelastic, slurm and mpi (see
:mod:`torchrig.builtins.clusters` for the whole order):

========  =============  ==============================================  ===========================================
priority  plugin         recognises                                      declines (returns ``None``) when
========  =============  ==============================================  ===========================================
20        env            torch's ``env://`` contract: ``RANK``,          one of the four is missing (``LOCAL_RANK``
                         ``WORLD_SIZE``, ``MASTER_ADDR``,                is optional): a Kubeflow PyTorchJob or a
                         ``MASTER_PORT`` (no launcher)                   JobSet running the script directly sets
                                                                         exactly these
10        process_group  a default process group of several ranks that   ``torch.distributed`` is not imported, no
                         already exists (created by the user, Ray,       default group is initialised, or it has one
                         another framework)                              rank (that says nothing the default doesn't)
========  =============  ==============================================  ===========================================

Why here: torchelastic needs ``LOCAL_RANK`` too, so a pod of a PyTorchJob that runs ``python
train.py`` (one process per pod, no ``LOCAL_RANK``) was read as one process; ``env`` reads it as
rank ``RANK`` of ``WORLD_SIZE`` with one process per node. A PyTorchJob that runs ``torchrun``
instead is torchelastic's (torchrun sets the full set). ``process_group`` is last among the real
environments: when variables describe the process, their plugin answers and the core checks the
existing group against that answer (:mod:`torchrig.distributed.process_group`); only when nothing describes
it (``dist.init_process_group`` on a ``FileStore`` with no variables) does the group itself say
where the process sits. Nothing here imports torch: ``process_group`` looks only at a
``torch.distributed`` that the process imported already.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from torchrig.builtins.clusters import _check_ranks, _int_var, _port_var
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import ClusterInfo

#: torch's ``env://`` rendezvous variables: what a Kubeflow PyTorchJob sets in every pod.
ENV_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _local_layout(environ: Mapping[str, str], plugin: str, rank: int, world_size: int,
                  default_local_world: int) -> tuple[int, int]:
    """``(local_rank, local_world_size)`` from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` when set."""
    if "LOCAL_RANK" not in environ:
        return (rank if default_local_world == world_size else 0), default_local_world
    local_rank = _int_var(environ, "LOCAL_RANK", plugin)
    if "LOCAL_WORLD_SIZE" in environ:
        local_world = _int_var(environ, "LOCAL_WORLD_SIZE", plugin, minimum=1)
    else:  # not said: the default layout, stretched to hold this local rank
        local_world = min(max(default_local_world, local_rank + 1), world_size)
    _check_ranks(plugin, ("LOCAL_RANK", local_rank), ("LOCAL_WORLD_SIZE", local_world))
    if local_world > world_size:
        raise ValueError(f"{plugin}: LOCAL_WORLD_SIZE={local_world} exceeds WORLD_SIZE={world_size}")
    return local_rank, local_world


class EnvCluster:
    """One process per pod (or per hand-started process), described by torch's ``env://`` variables.

    - rank ``RANK``, world size ``WORLD_SIZE``, rendezvous ``MASTER_ADDR:MASTER_PORT``;
    - ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` when set, else one process per node (local rank 0 of
      1, node rank = rank): what a PyTorchJob's pods are.
    """

    name = "env"

    @hookimpl
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo | None:
        if not all(name in environ for name in ENV_VARIABLES):
            return None
        p = "env"
        rank = _int_var(environ, "RANK", p)
        world_size = _int_var(environ, "WORLD_SIZE", p, minimum=1)
        _check_ranks(p, ("RANK", rank), ("WORLD_SIZE", world_size))
        local_rank, local_world = _local_layout(environ, p, rank, world_size, 1)
        port = _port_var(environ, "MASTER_PORT", p)
        addr = environ["MASTER_ADDR"].strip()
        if not addr:
            raise ValueError(f"{p}: MASTER_ADDR is empty; set it to the host of rank 0")
        return ClusterInfo(
            rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world,
            node_rank=(rank - local_rank) // local_world, num_nodes=-(-world_size // local_world),
            master_addr=addr, master_port=port, source="env",
        )


def existing_default_group() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the default process group if this process already has one,
    without importing torch (no group can exist before ``torch.distributed`` is imported)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


class ProcessGroupCluster:
    """A process whose default process group someone else created, and no variables describe.

    Rank and world size are the group's; ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` when set, else
    every rank on one node (export ``LOCAL_RANK`` for a multi-node group: the device of a rank
    is chosen by its local rank). No rendezvous address: the group exists, nothing joins it.
    """

    name = "process_group"

    @hookimpl
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo | None:
        group = existing_default_group()
        if group is None or group[1] <= 1:
            return None
        rank, world_size = group
        local_rank, local_world = _local_layout(environ, "process_group", rank, world_size, world_size)
        return ClusterInfo(
            rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world,
            node_rank=(rank - local_rank) // local_world, num_nodes=-(-world_size // local_world),
            source="process_group",
        )


__all__ = ["ENV_VARIABLES", "EnvCluster", "ProcessGroupCluster", "existing_default_group"]
