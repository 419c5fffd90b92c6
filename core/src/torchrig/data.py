"""The core's default dataloader preparation: shard across data-parallel ranks, move to device.

Data-parallel sharding is the same for DDP, FSDP and DeepSpeed, so it lives in the core,
parametrised by the strategy's declared ``data_parallel_size``/``data_parallel_rank``
(:class:`~torchrig.types.Capabilities`); strategies do not re-implement it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from torchrig.collectives import recursively_apply

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.run import RunContext


class IterableShard(IterableDataset):
    """Every ``num_shards``-th sample of an iterable dataset, starting at ``shard``."""

    def __init__(self, dataset: IterableDataset, num_shards: int, shard: int) -> None:
        self.dataset, self.num_shards, self.shard = dataset, num_shards, shard

    def __iter__(self) -> Iterator[Any]:
        for index, sample in enumerate(self.dataset):
            if index % self.num_shards == self.shard:
                yield sample


class DeviceDataLoader:
    """Iterates the (sharded) loader and moves each batch's tensors to the run's device.

    Each new pass calls ``set_epoch`` on a distributed sampler so shuffled epochs differ.
    """

    def __init__(self, dataloader: DataLoader, device: torch.device, non_blocking: bool = False) -> None:
        self.dataloader = dataloader
        self.device = device
        self.non_blocking = non_blocking
        self.epoch = 0

    def __iter__(self) -> Iterator[Any]:
        sampler = getattr(self.dataloader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(self.epoch)
        self.epoch += 1
        device, non_blocking = self.device, self.non_blocking
        for batch in self.dataloader:
            yield recursively_apply(lambda t: t.to(device, non_blocking=non_blocking), batch)

    def __len__(self) -> int:
        return len(self.dataloader)

    def __getattr__(self, name: str) -> Any:
        if name == "dataloader":  # not yet set during unpickling
            raise AttributeError(name)
        return getattr(self.dataloader, name)


def shard_dataloader(dataloader: DataLoader, num_replicas: int, rank: int) -> DataLoader:
    """A DataLoader over this rank's share of ``dataloader``'s samples."""
    dataset = dataloader.dataset
    common = dict(
        num_workers=dataloader.num_workers,
        collate_fn=dataloader.collate_fn,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        persistent_workers=dataloader.persistent_workers,
    )
    if isinstance(dataset, IterableDataset):
        return DataLoader(
            IterableShard(dataset, num_replicas, rank),
            batch_size=dataloader.batch_size,
            drop_last=dataloader.drop_last,
            **common,
        )
    if dataloader.batch_size is None:
        raise ValueError(
            "prepare(): a DataLoader built with a custom batch_sampler cannot be sharded across "
            f"{num_replicas} processes automatically; build it with batch_size= and a sampler instead"
        )
    sampler = DistributedSampler(
        dataset,
        num_replicas=num_replicas,
        rank=rank,
        shuffle=isinstance(dataloader.sampler, RandomSampler),
        drop_last=dataloader.drop_last,
    )
    return DataLoader(
        dataset, batch_size=dataloader.batch_size, sampler=sampler, drop_last=dataloader.drop_last, **common
    )


def prepare_dataloader(run: RunContext, dataloader: DataLoader) -> DeviceDataLoader:
    """Shard ``dataloader`` by the strategy's data-parallel layout and place batches on device."""
    caps = run.capabilities
    size = (caps.data_parallel_size if caps else None) or run.cluster.world_size
    rank = (caps.data_parallel_rank if caps else None) or run.cluster.rank
    if size > 1:
        dataloader = shard_dataloader(dataloader, size, rank)
    assert run.device is not None
    return DeviceDataLoader(dataloader, run.device.device)


__all__ = ["DeviceDataLoader", "IterableShard", "prepare_dataloader", "shard_dataloader"]
