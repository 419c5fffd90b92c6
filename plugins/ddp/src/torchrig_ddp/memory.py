"""DDP's per-rank memory (torch-free): everything whole on every rank, plus the reducer's gradient
buckets — flat copies of every gradient that all-reduce runs on — unless ``gradient_as_bucket_view``
makes the gradients views into them (read from the typed section)."""

from __future__ import annotations

import attrs
from torchrig.plugin import MemoryComponent, MemoryEstimate, MemoryRequest, replicated_estimate

from torchrig_ddp.options import DistributedDataParallelKwargs


def ddp_estimate(request: MemoryRequest) -> MemoryEstimate:
    estimate = replicated_estimate(request, "ddp", "ddp (replicated)")
    if request.world_size <= 1:
        return attrs.evolve(estimate, notes=(*estimate.notes, "one process: DDP builds no gradient buckets"))
    if request.config.section_of(DistributedDataParallelKwargs).gradient_as_bucket_view:
        return attrs.evolve(estimate, notes=(*estimate.notes, (
            "gradient_as_bucket_view: gradients live in the all-reduce buckets, no second copy")))
    buckets = MemoryComponent("gradient buckets", estimate.component("gradients"),
                              note="the reducer's flat bucket copy of every gradient")
    return attrs.evolve(estimate, components=(*estimate.components, buckets))


__all__ = ["ddp_estimate"]
