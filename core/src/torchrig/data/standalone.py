"""Accelerate's standalone data functions (``accelerate.data_loader``): ``prepare_data_loader``,
``skip_first_batches``, ``SkipBatchSampler``, ``get_sampler`` — usable without an Accelerator, on
prepared and plain DataLoaders."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from torchrig.data.loader import PreparedDataLoader
from torchrig.data.plan import LOADER_KWARGS
from torchrig.distributed.process import PartialState, world_collectives
from torchrig.host.runtime import latest_run
from torchrig.training.gradient_state import gradient_state_of


class SkipBatchSampler(Sampler[list[Any]]):
    """A batch sampler without the first ``skip_batches`` batches of ``batch_sampler`` (on every pass)."""

    def __init__(self, batch_sampler: Any, skip_batches: int = 0) -> None:
        self.batch_sampler, self.skip_batches = batch_sampler, skip_batches

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.batch_sampler), self.skip_batches, None)

    @property
    def total_length(self) -> int:
        return len(self.batch_sampler)

    def __len__(self) -> int:
        return max(0, len(self.batch_sampler) - self.skip_batches)


class _SkipIterableLoader:
    """An unprepared iterable-dataset DataLoader minus its first batches (read and dropped)."""

    def __init__(self, dataloader: DataLoader, skip: int) -> None:
        self.base_dataloader, self.skip = dataloader, skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.base_dataloader), self.skip, None)

    def __len__(self) -> int:
        return max(0, len(self.base_dataloader) - self.skip)

    def __getattr__(self, name: str) -> Any:
        if name == "base_dataloader" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)


def get_sampler(dataloader: Any) -> Any:
    """The sampler that orders ``dataloader``'s samples (for a prepared loader: the one that
    replaced a ``RandomSampler``, else the user's)."""
    if isinstance(dataloader, PreparedDataLoader):
        return dataloader.sampler
    if isinstance(dataloader.sampler, BatchSampler):
        return getattr(dataloader.sampler, "sampler", None)
    return getattr(dataloader.batch_sampler, "sampler", None)


def prepare_data_loader(dataloader: DataLoader, device: torch.device | str | None = None,
                        num_processes: int | None = None, process_index: int | None = None,
                        split_batches: bool = False, put_on_device: bool = False, rng_types: Any = None,
                        dispatch_batches: bool | None = None, even_batches: bool = True,
                        slice_fn_for_dispatch: Any = None, use_seedable_sampler: bool = False,
                        data_seed: int | None = None, non_blocking: bool = False, use_stateful_dataloader: bool = False,
                        torch_device_mesh: Any = None) -> PreparedDataLoader:
    """Accelerate's standalone ``prepare_data_loader``: ``dataloader`` sharded for process
    ``process_index`` of ``num_processes`` (default: this process in this job), batches moved to
    ``device`` when ``put_on_device`` — without an ``Accelerator``.

    Every prepared loader shuffles from its own seeded generator, identical on every process, and
    is resumable: ``rng_types``, ``use_seedable_sampler`` and ``use_stateful_dataloader`` therefore
    need nothing more (no global RNG is synchronised or consumed).
    """
    if slice_fn_for_dispatch is not None:
        raise ValueError("prepare_data_loader(slice_fn_for_dispatch=...): torchrig dispatches per-process batches "
                         "cut before collation, so there is no slicing function to give")
    if torch_device_mesh is not None:
        raise ValueError("prepare_data_loader(torch_device_mesh=...): device meshes (tensor/context parallelism) are "
                         "not available yet; shard by num_processes/process_index")
    state = PartialState()
    run = latest_run()
    return PreparedDataLoader(
        dataloader,
        num_replicas=state.num_processes if num_processes is None else num_processes,
        rank=state.process_index if process_index is None else process_index,
        device=(device if device is not None else state.device) if put_on_device else None,
        non_blocking=non_blocking,
        split_batches=split_batches,
        even_batches=even_batches,
        dispatch_batches=dispatch_batches,
        seed=data_seed,
        collectives=world_collectives(),
        is_source=state.is_main_process,
        gradient_state=gradient_state_of(run) if run is not None else None,
    )


def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
    """A loader whose next pass starts ``num_batches`` batches into the epoch (Accelerate's API).

    For a prepared loader: a copy whose next pass is the epoch ``dataloader`` would run next,
    started ``num_batches`` of this rank's batches in (skipped in index space: nothing is
    loaded); its ``len`` is the remaining count until that pass ends, and later passes are whole
    epochs. Iterating the copy consumes ``dataloader``'s next pass (as Accelerate's resume pattern
    expects after ``load_state``): ``dataloader`` then records that pass's position in a checkpoint
    and goes on with the following epoch. For a plain DataLoader: map-style data skips
    the first batches of its batch sampler (on every pass), iterable data reads and drops them.
    """
    if num_batches < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}")
    if isinstance(dataloader, PreparedDataLoader):
        return dataloader._skipped(num_batches)
    if isinstance(dataloader, DataLoader):
        if isinstance(dataloader.dataset, IterableDataset) or dataloader.batch_sampler is None:
            return _SkipIterableLoader(dataloader, num_batches)
        kwargs: dict[str, Any] = {k: getattr(dataloader, k) for k in LOADER_KWARGS}
        if dataloader.num_workers > 0:
            kwargs["prefetch_factor"] = dataloader.prefetch_factor
            kwargs["multiprocessing_context"] = dataloader.multiprocessing_context
        return DataLoader(
            dataloader.dataset,
            batch_sampler=SkipBatchSampler(dataloader.batch_sampler, num_batches),
            collate_fn=dataloader.collate_fn,
            generator=dataloader.generator,
            **kwargs,
        )
    raise TypeError(f"skip_first_batches(): expected a DataLoader, got {type(dataloader).__name__}")


__all__ = ["SkipBatchSampler", "get_sampler", "prepare_data_loader", "skip_first_batches"]
