"""The ``torchelastic`` cluster environment (priority 50, asked first among the built-ins): workers
started by torch elastic (``torchrun``, ``torchrig launch``). Why first: see :mod:`torchrig.builtins.clusters`.
Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import ClusterInfo

#: Set by torch elastic for every worker it starts.
ELASTIC_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: Set by torch elastic's agent (``torchrun``, ``torchrig launch``) for every worker; the mark that
#: elastic, not a user's ``export RANK=...``, started this process.
ELASTIC_RUN_ID = "TORCHELASTIC_RUN_ID"


class TorchElasticCluster:
    @hookimpl
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo | None:
        if not all(name in environ for name in ELASTIC_VARIABLES):
            return None
        try:
            world_size = int(environ["WORLD_SIZE"])
            local_world_size = int(environ.get("LOCAL_WORLD_SIZE", world_size))
            return ClusterInfo(
                rank=int(environ["RANK"]),
                local_rank=int(environ["LOCAL_RANK"]),
                world_size=world_size,
                local_world_size=local_world_size,
                node_rank=int(environ.get("GROUP_RANK", 0)),
                num_nodes=max(1, world_size // max(local_world_size, 1)),
                master_addr=environ["MASTER_ADDR"],
                master_port=int(environ["MASTER_PORT"]),
                source="torchelastic",
            )
        except ValueError as exc:
            raise ValueError(f"torch elastic variables are malformed ({exc}): "
                             + ", ".join(f"{v}={environ.get(v)!r}" for v in ELASTIC_VARIABLES)) from exc


def started_by_elastic(environ: Mapping[str, str]) -> bool:
    """True when torch elastic started this process: all of its worker variables and its run id."""
    return all(name in environ for name in ELASTIC_VARIABLES) and ELASTIC_RUN_ID in environ


__all__ = ["ELASTIC_RUN_ID", "ELASTIC_VARIABLES", "TorchElasticCluster", "started_by_elastic"]
