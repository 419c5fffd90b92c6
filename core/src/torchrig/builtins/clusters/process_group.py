"""The ``process_group`` cluster environment (priority 10, the last real one): a default process
group that someone else created (the user, Ray, another framework) and no variables describe.

When variables describe the process, their plugin answers and the core checks the existing group
against that answer (:mod:`torchrig.distributed.process_group`, which also asks
:func:`existing_default_group`); only when nothing describes it (``dist.init_process_group`` on a
``FileStore`` with no variables) does the group itself say where the process sits. Nothing here
imports torch: it looks only at a ``torch.distributed`` that the process imported already.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from torchrig.builtins.clusters.cluster_environment import local_layout
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import ClusterInfo


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
        local_rank, local_world = local_layout(environ, "process_group", rank, world_size, world_size)
        return ClusterInfo(
            rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world,
            node_rank=(rank - local_rank) // local_world, num_nodes=-(-world_size // local_world),
            source="process_group",
        )


__all__ = ["ProcessGroupCluster", "existing_default_group"]
