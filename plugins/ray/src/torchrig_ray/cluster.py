"""The ``ray`` cluster plugin: a training function running inside ``ray.train.torch.TorchTrainer``.

Ray Train starts one worker process per ``ScalingConfig.num_workers``, creates the default
process group in every worker (``dist.init_process_group`` with gloo on CPU, nccl on GPU) and
then calls the training function. An ``Accelerator()`` created there asks this plugin first
(priority 60, above torchelastic: Ray also exports ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``, but
its context is the authority): ranks and sizes come from ``ray.train.get_context()``, and the
core adopts the group Ray created instead of creating one (:mod:`torchrig.distributed.process_group`).

Detection costs nothing outside Ray: the plugin declines unless ``RAY_RAYLET_PID`` is in the
environment (Ray sets it in every process its raylet starts; a driver script that calls
``ray.init`` has none), and imports Ray only then. Inside a Ray worker that is not a Train
worker (a plain task or actor) ``get_context()`` fails and the plugin declines.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchrig.plugin import ClusterInfo, hookimpl

#: Set by Ray's raylet in every worker process it starts.
RAY_WORKER_VARIABLE = "RAY_RAYLET_PID"


def _port(environ: Mapping[str, str]) -> int | None:
    raw = environ.get("MASTER_PORT", "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"ray: MASTER_PORT={environ['MASTER_PORT']!r} is not an integer") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"ray: MASTER_PORT={environ['MASTER_PORT']!r} is not a TCP port (1-65535)")
    return port


def train_context() -> object | None:
    """Ray Train's context in this worker, or ``None`` outside a Train worker."""
    import ray.train  # a Ray worker: Ray is installed and, in a Train worker, already imported

    try:
        context = ray.train.get_context()
        context.get_world_size()  # Ray Train v1 hands out a context that fails only when asked
    except (RuntimeError, ValueError, AttributeError):
        return None
    return context


class RayTrainCluster:
    """Where a Ray Train worker sits: ``get_world_rank()``, ``get_local_rank()``,
    ``get_world_size()``, ``get_local_world_size()``, ``get_node_rank()`` of its context; the
    rendezvous ``MASTER_ADDR``/``MASTER_PORT`` Ray exported (``TorchConfig(init_method="env")``,
    its default), informational since the group exists already."""

    name = "ray"

    @hookimpl
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo | None:
        if RAY_WORKER_VARIABLE not in environ:
            return None
        context = train_context()
        if context is None:
            return None
        world_size = int(context.get_world_size())
        local_world_size = int(context.get_local_world_size())
        return ClusterInfo(
            rank=int(context.get_world_rank()),
            local_rank=int(context.get_local_rank()),
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=int(context.get_node_rank()),
            num_nodes=max(1, -(-world_size // max(local_world_size, 1))),
            master_addr=environ.get("MASTER_ADDR", "").strip() or None,
            master_port=_port(environ),
            source="ray",
        )


__all__ = ["RAY_WORKER_VARIABLE", "RayTrainCluster", "train_context"]
