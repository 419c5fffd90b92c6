"""The ``single`` strategy: one process, one device. It owns nothing, so every phase uses the
core's plain-PyTorch defaults; it only refuses to run in a multi-process job, where each rank
would silently train its own model."""

from __future__ import annotations

from torchrig.host.run import RunContext
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import Capabilities


class SingleProcessStrategy:
    @hookimpl
    def torchrig_strategy_capabilities(self, run: RunContext) -> Capabilities:
        if run.cluster.world_size > 1:
            raise RuntimeError(
                f"strategy 'single' was selected but this job has {run.cluster.world_size} processes "
                f"(rank {run.cluster.rank}); each would train its own copy of the model. "
                "Select a distributed strategy (e.g. --strategy ddp) or launch one process."
            )
        return Capabilities(replicated_parameters=True, data_parallel_size=1, data_parallel_rank=0)
