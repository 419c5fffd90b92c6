"""Built-in cluster environment: ``torchelastic`` — processes started by torch elastic
(``torchrun`` or ``torchrig launch``), recognised by the variables elastic sets for each worker."""

from __future__ import annotations

from collections.abc import Mapping

from torchrig.markers import hookimpl
from torchrig.types import ClusterInfo

#: Set by torch elastic for every worker it starts.
ELASTIC_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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
