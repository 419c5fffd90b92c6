"""The ``local`` cluster environment (priority -100): one process, rank 0 of 1, whatever the
environment says — the explicit ``cluster: local``. Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import ClusterInfo


class LocalCluster:
    """One process, rank 0 of 1, whatever the environment says.

    For ``cluster: local``: running a script single-process inside an environment with
    ``RANK``/``WORLD_SIZE`` or ``SLURM_*`` leftovers (an ``srun`` shell, a notebook started by a
    launcher). Its priority is the lowest, so in auto-detection it answers only after every
    real environment declined, with what the core default would answer.
    """

    name = "local"

    @hookimpl
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo:
        return ClusterInfo(source="local")


__all__ = ["LocalCluster"]
