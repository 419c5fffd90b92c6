"""The core's torch-free defaults: configuration sections, cluster, requeue, memory estimate and
worker environment. Registered as ``"core:defaults"`` by every
:class:`~torchrig.host.plugin_host.PluginHost` (the CLI's too, so this module never imports torch)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchrig.config.options import CORE_SECTIONS
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import ClusterInfo, LaunchPlan

if TYPE_CHECKING:
    from torchrig.estimate.memory import MemoryEstimate, MemoryRequest

#: The pluggy name of this family (``torchrig config`` calls its sections "the core").
NAME = "core:defaults"


class ConfigurationDefaults:
    """What the core answers before any runtime exists (launcher, CLI, workers)."""

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
    def torchrig_estimate_memory(self, request: MemoryRequest) -> MemoryEstimate:
        # Imported here: only `torchrig estimate-memory` asks, and every run's start would pay
        # for the module's classes otherwise (benchmark B12).
        from torchrig.estimate.memory import replicated_estimate

        return replicated_estimate(request, request.strategy, f"{request.strategy} (replicated: everything whole)")

    @hookimpl
    def torchrig_worker_environment(self, plan: LaunchPlan) -> dict[str, str]:
        """One OpenMP thread per core share: N workers on few cores otherwise oversubscribe."""
        if "OMP_NUM_THREADS" in os.environ or plan.nproc_per_node <= 1:
            return {}
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return {"OMP_NUM_THREADS": str(max(1, cores // plan.nproc_per_node))}


__all__ = ["NAME", "ConfigurationDefaults"]
