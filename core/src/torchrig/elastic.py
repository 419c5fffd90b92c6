"""The core's default launch: torch.distributed.elastic, the engine torchrun uses.

``torchrig launch`` builds a :class:`~torchrig.types.LaunchPlan`; this module turns it into an
elastic ``LaunchConfig`` and runs the workers of this node. A single node uses a c10d
rendezvous on a free port (``127.0.0.1:0``), like ``torchrun --standalone``.
"""

from __future__ import annotations

import os
import uuid

from torchrig.types import LaunchPlan


def launch_with_elastic(plan: LaunchPlan) -> int:
    """Start ``plan.nproc_per_node`` workers running ``plan.command``; 0 on success, 1 on failure."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if not plan.command:
        raise ValueError("LaunchPlan.command is empty: nothing to launch")
    rdzv_configs: dict[str, object] = {"rank": plan.node_rank} if plan.num_nodes > 1 else {}
    if plan.num_nodes == 1:
        rdzv_configs["is_host"] = True
    config = LaunchConfig(
        min_nodes=plan.num_nodes,
        max_nodes=plan.num_nodes,
        nproc_per_node=plan.nproc_per_node,
        run_id=plan.run_id if plan.num_nodes > 1 else f"{plan.run_id}-{uuid.uuid4().hex[:8]}",
        rdzv_endpoint=plan.rdzv_endpoint,
        rdzv_backend=plan.rdzv_backend,
        rdzv_configs=rdzv_configs,
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
        start_method="spawn",
    )
    # Workers inherit the launcher's environment; this process exists to launch them.
    os.environ.update(plan.env)
    entrypoint, *args = plan.command
    try:
        elastic_launch(config, entrypoint)(*args)
    except ChildFailedError:
        return 1
    return 0


__all__ = ["launch_with_elastic"]
