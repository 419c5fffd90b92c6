"""The core's default hook implementations: one ``trylast`` answer for every firstresult hook.

Registered first, as ``"core:defaults"``, by every :class:`~torchrig.plugin_host.PluginHost`,
so "nobody answered" cannot happen. This module stays importable without torch (the CLI
registers it too); torch is imported inside the implementations that need it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from torchrig.config.options import CORE_SECTIONS, InitProcessGroupKwargs
from torchrig.markers import hookimpl
from torchrig.memory import MemoryEstimate, MemoryRequest, replicated_estimate
from torchrig.types import Capabilities, ClusterInfo, LaunchPlan, PreparedModel

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.checkpoint.files import CheckpointWriter
    from torchrig.run import RunContext

def apply_timeout_to_later_groups(timeout: Any) -> None:
    """One collective timeout for every process group: groups created later without an explicit
    timeout (``new_group``, device meshes) take torch's process-wide defaults, so set those too
    (Accelerate applies the user's timeout to the default group only: accelerate#2236, #3711)."""
    import torch.distributed.distributed_c10d as c10d

    c10d.default_pg_timeout = timeout
    if getattr(c10d, "default_pg_nccl_timeout", None) is not None:
        c10d.default_pg_nccl_timeout = timeout


class CoreDefaults:
    """What the core does when no plugin answers."""

    @hookimpl
    def torchrig_config_sections(self) -> list[Any]:
        return list(CORE_SECTIONS)

    @hookimpl(trylast=True)
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo:
        return ClusterInfo()

    @hookimpl(trylast=True)
    def torchrig_requeue_command(self, environ: Mapping[str, str]) -> list[str]:
        return []

    @hookimpl(trylast=True)
    def torchrig_select_device(self, run: RunContext) -> Any:
        from torchrig.builtins.devices import CPUBackend

        return CPUBackend()

    @hookimpl(trylast=True)
    def torchrig_init_process_group(self, run: RunContext) -> bool:
        if run.cluster.world_size <= 1:
            return True
        import datetime

        import torch.distributed as dist

        # The default (1800 s) is declared once, on InitProcessGroupKwargs.timeout.
        timeout = datetime.timedelta(seconds=float(run.section(InitProcessGroupKwargs).timeout))
        apply_timeout_to_later_groups(timeout)
        if dist.is_initialized():
            if dist.get_world_size() != run.cluster.world_size:
                raise RuntimeError(
                    f"a process group of world size {dist.get_world_size()} already exists, "
                    f"but this run expects {run.cluster.world_size}"
                )
            return True
        assert run.device is not None
        dist.init_process_group(
            backend=run.option("init_process_group_kwargs.backend") or run.device.dist_backend,
            init_method=run.option("init_process_group_kwargs.init_method")
            or f"tcp://{run.cluster.master_addr}:{run.cluster.master_port}",
            rank=run.cluster.rank,
            world_size=run.cluster.world_size,
            timeout=timeout,
        )
        return True

    @hookimpl(trylast=True)
    def torchrig_collectives(self, run: RunContext) -> Any:
        from torchrig.collectives import Collectives

        return Collectives(world_size=run.cluster.world_size)

    @hookimpl(trylast=True)
    def torchrig_strategy_capabilities(self, run: RunContext) -> Capabilities:
        return Capabilities(replicated_parameters=True, data_parallel_size=run.cluster.world_size,
                            data_parallel_rank=run.cluster.rank)

    @hookimpl(trylast=True)
    def torchrig_prepare_model(
        self, run: RunContext, model: Any, optimizers: Sequence[Any], schedulers: Sequence[Any], device_placement: bool
    ) -> PreparedModel:
        assert run.device is not None
        if device_placement:
            model.to(run.device.device)
        return PreparedModel(model=model, unwrapped=model, optimizers=list(optimizers), schedulers=list(schedulers))

    @hookimpl(trylast=True)
    def torchrig_prepare_dataloader(self, run: RunContext, dataloader: Any, device_placement: bool) -> Any:
        from torchrig.data import prepare_dataloader

        return prepare_dataloader(run, dataloader, device_placement=device_placement)

    @hookimpl(trylast=True)
    def torchrig_prepare_scheduler(self, run: RunContext, scheduler: Any, optimizers: Sequence[Any]) -> Any:
        from torchrig.gradient_state import gradient_state_of
        from torchrig.scheduler import OptimizerStepScheduler

        return OptimizerStepScheduler(scheduler, optimizers, gradient_state_of(run))

    @hookimpl(trylast=True)
    def torchrig_save_strategy_state(
        self, run: RunContext, prepared: Sequence[PreparedModel], writer: CheckpointWriter
    ) -> list[str]:
        from torchrig.checkpoint.state_dicts import save_plain_state

        return save_plain_state(run, prepared, writer)

    @hookimpl(trylast=True)
    def torchrig_load_strategy_state(self, run: RunContext, prepared: Sequence[PreparedModel], directory: str) -> bool:
        from torchrig.checkpoint.state_dicts import load_plain_state

        load_plain_state(run, prepared, directory)
        return True

    @hookimpl(trylast=True)
    def torchrig_full_state_dict(self, run: RunContext, prepared: PreparedModel) -> dict[str, Any]:
        return prepared.unwrapped.state_dict()

    @hookimpl(trylast=True)
    def torchrig_estimate_memory(self, request: MemoryRequest) -> MemoryEstimate:
        return replicated_estimate(request, request.strategy, f"{request.strategy} (replicated: everything whole)")

    @hookimpl(trylast=True)
    def torchrig_launch(self, plan: LaunchPlan) -> int:
        from torchrig.launch.elastic import launch_with_elastic

        return launch_with_elastic(plan)

    @hookimpl
    def torchrig_worker_environment(self, plan: LaunchPlan) -> dict[str, str]:
        """One OpenMP thread per core share: N workers on few cores otherwise oversubscribe."""
        if "OMP_NUM_THREADS" in os.environ or plan.nproc_per_node <= 1:
            return {}
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return {"OMP_NUM_THREADS": str(max(1, cores // plan.nproc_per_node))}


__all__ = ["CoreDefaults"]
