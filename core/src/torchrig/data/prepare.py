"""Prepared loaders from a run (the ``torchrig_prepare_dataloader`` default) or from explicit
ranks (:func:`shard_dataloader`, no run needed)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader

from torchrig.config.options import DataLoaderConfiguration
from torchrig.data.loader import PreparedDataLoader
from torchrig.distributed.collectives import Collectives
from torchrig.host.run import RunContext
from torchrig.training.gradient_state import gradient_state_of


def _data_parallel_layout(run: RunContext) -> tuple[int, int]:
    caps = run.capabilities
    size = getattr(caps, "data_parallel_size", None)
    rank = getattr(caps, "data_parallel_rank", None)
    return (run.cluster.world_size if size is None else size), (run.cluster.rank if rank is None else rank)


def prepare_dataloader(run: RunContext, dataloader: Any, *, device_placement: bool | None = None) -> PreparedDataLoader:
    """``dataloader`` rebuilt for this rank from the run's ``dataloader_config`` (module docstring).

    ``device_placement=False`` leaves batches where the DataLoader puts them. A loader that is
    already prepared is returned as it is.
    """
    if isinstance(dataloader, PreparedDataLoader):
        return dataloader
    size, rank = _data_parallel_layout(run)
    collectives = run.collectives
    if collectives is None and run.cluster.world_size > 1:
        collectives = Collectives(world_size=run.cluster.world_size)
    device = run.device.device if (device_placement is not False and run.device is not None) else None
    options = run.section(DataLoaderConfiguration)  # each default declared once, on the class
    return PreparedDataLoader(
        dataloader,
        num_replicas=size,
        rank=rank,
        device=device,
        non_blocking=bool(options.non_blocking),
        split_batches=bool(options.split_batches),
        even_batches=bool(options.even_batches),
        dispatch_batches=options.dispatch_batches,
        seed=options.data_seed,
        use_configured_sampler=bool(options.use_configured_sampler),
        collectives=collectives,
        is_source=run.cluster.rank == 0,
        gradient_state=gradient_state_of(run),
    )


def shard_dataloader(
    dataloader: DataLoader,
    num_replicas: int,
    rank: int,
    *,
    split_batches: bool = False,
    even_batches: bool = True,
    seed: int | None = None,
) -> PreparedDataLoader:
    """Rank ``rank``'s share of ``dataloader`` among ``num_replicas``, without a run: no device
    placement, no dispatch (every rank reads the data), a private gradient state. ``seed``
    defaults as in :func:`prepare_dataloader` but without the broadcast, so pass one when ranks'
    global RNGs may differ."""
    return PreparedDataLoader(
        dataloader,
        num_replicas=num_replicas,
        rank=rank,
        split_batches=split_batches,
        even_batches=even_batches,
        dispatch_batches=False,
        seed=seed,
    )


__all__ = ["prepare_dataloader", "shard_dataloader"]
