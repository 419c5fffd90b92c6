"""The ``env`` cluster environment (priority 20): torch's ``env://`` variables with no launcher.

torchelastic needs ``LOCAL_RANK`` too, so a pod of a Kubeflow PyTorchJob that runs ``python train.py``
(one process per pod, no ``LOCAL_RANK``) would be read as one process; ``env`` reads it as rank ``RANK``
of ``WORLD_SIZE`` with one process per node. A PyTorchJob that runs ``torchrun`` instead is
torchelastic's (torchrun sets the full set). Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchrig.builtins.clusters.cluster_environment import check_ranks, int_var, local_layout, port_var
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import ClusterInfo

#: torch's ``env://`` rendezvous variables: what a Kubeflow PyTorchJob sets in every pod.
ENV_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
        rank = int_var(environ, "RANK", p)
        world_size = int_var(environ, "WORLD_SIZE", p, minimum=1)
        check_ranks(p, ("RANK", rank), ("WORLD_SIZE", world_size))
        local_rank, local_world = local_layout(environ, p, rank, world_size, 1)
        port = port_var(environ, "MASTER_PORT", p)
        addr = environ["MASTER_ADDR"].strip()
        if not addr:
            raise ValueError(f"{p}: MASTER_ADDR is empty; set it to the host of rank 0")
        return ClusterInfo(
            rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world,
            node_rank=(rank - local_rank) // local_world, num_nodes=-(-world_size // local_world),
            master_addr=addr, master_port=port, source="env",
        )


__all__ = ["ENV_VARIABLES", "EnvCluster"]
