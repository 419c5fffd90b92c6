"""Reading a user's DataLoader once, when it is prepared: what it batches and how, this rank's
share of each batch, the shuffling seed and sampler, and the arguments to rebuild it with.

Separate from :mod:`torchrig.data.loader`, whose prepared loader runs passes over what is read
here: the constructor's questions (a torch ``BatchSampler`` or a custom one? whose seed? which
sampler is replaced?) are asked once and never on the per-batch path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler

from torchrig.data.plan import LOADER_KWARGS, Layout
from torchrig.data.seeding import SeedableRandomSampler, derive_seed

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.distributed.collectives import Collectives


@attrs.frozen
class LoaderReading:
    """What :func:`read_user_dataloader` found; the prepared loader keeps each as an attribute."""

    #: "index" (a sampler of indices), "batches" (a custom batch sampler) or "iterable".
    kind: str
    #: False for ``batch_size=None`` (every sample is a unit, converted, not collated).
    auto_collation: bool
    #: The sampler the rebuilt loader draws from (a :class:`SeedableRandomSampler` in place of a RandomSampler).
    sampler: Any
    #: "seedable", "sequential", "custom" or "none".
    sampler_kind: str
    custom_batches: Any
    drop_last: bool
    layout: Layout
    seed: int
    #: Where the seed came from: "config" (data_seed), "generator" (the user's) or "global_rng" (drawn).
    seed_source: str
    dispatch_batches: bool
    is_source: bool
    loader_kwargs: dict[str, Any]


def check_dataloader(dataloader: Any, num_replicas: int, rank: int) -> None:
    """``prepare()`` was given a DataLoader, and ``rank`` is one of ``num_replicas`` processes."""
    if not isinstance(dataloader, DataLoader):
        raise TypeError(f"prepare(): expected a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank} is not a valid rank of {num_replicas} data-parallel processes")


def read_user_dataloader(
    dataloader: DataLoader,
    *,
    num_replicas: int,
    rank: int,
    split_batches: bool,
    even_batches: bool,
    dispatch_batches: bool | None,
    seed: int | None,
    use_configured_sampler: bool,
    collectives: Collectives | None,
    is_source: bool | None,
) -> LoaderReading:
    """Read what the prepared loader needs from ``dataloader`` (checked by :func:`check_dataloader`;
    arguments: :class:`~torchrig.data.loader.PreparedDataLoader`), raising on a batch size that
    cannot be split or batches that cannot be dispatched. Without a ``seed``, one is drawn from
    the global RNG and broadcast — a collective every rank calls here."""
    dataset = dataloader.dataset
    world = num_replicas
    iterable = isinstance(dataset, IterableDataset)
    user_batch_sampler = dataloader.batch_sampler
    auto_collation = user_batch_sampler is not None
    sampler = None if iterable else dataloader.sampler
    batch_size = dataloader.batch_size
    drop_last = dataloader.drop_last
    custom_batches: Any = None
    if not iterable and user_batch_sampler is not None and batch_size is None:
        if type(user_batch_sampler) is BatchSampler:  # an explicit torch BatchSampler: unpack it
            sampler, batch_size = user_batch_sampler.sampler, user_batch_sampler.batch_size
            drop_last = user_batch_sampler.drop_last
        else:
            custom_batches = user_batch_sampler
            drop_last = bool(getattr(user_batch_sampler, "drop_last", False))
    kind = "iterable" if iterable else ("batches" if custom_batches is not None else "index")

    per_rank: int | None
    if kind == "batches":
        per_rank = None
    else:
        unit = batch_size if auto_collation else 1
        assert unit is not None
        if split_batches:
            if not auto_collation:
                raise ValueError("split_batches=True needs a DataLoader with a batch size (not batch_size=None)")
            if unit % world:
                raise ValueError(
                    f"split_batches=True: the batch size ({unit}) must be a multiple of the number of "
                    f"data-parallel processes ({world}) to split every batch into {world} equal parts"
                )
            per_rank = unit // world
        else:
            per_rank = unit
    # Padding only ever serves to keep several ranks in step: one process never repeats a sample.
    layout = Layout(world, rank, per_rank, split_batches, even_batches and world > 1, drop_last)

    # Seed: config > the user's generator > one draw from the global RNG (:mod:`torchrig.data`'s docstring).
    seed_source = "config"
    if seed is None:
        user_generator = dataloader.generator or getattr(sampler, "generator", None)
        if user_generator is not None:
            seed = int(user_generator.initial_seed())
            seed_source = "generator"
        else:
            seed_source = "global_rng"
            # Broadcast even when world == 1: ranks outside data parallelism (tensor/pipeline
            # parallel peers) read the same data and must shuffle it the same way.
            seed = derive_seed(collectives)
    seed = int(seed)

    sampler_kind = "none"
    if kind == "index":
        if type(sampler) is RandomSampler and not use_configured_sampler:
            sampler = SeedableRandomSampler(
                dataset, seed=seed, replacement=sampler.replacement, num_samples=sampler._num_samples
            )
            sampler_kind = "seedable"
        elif type(sampler) is SequentialSampler:
            sampler_kind = "sequential"
        else:
            sampler_kind = "custom"

    if dispatch_batches is None:
        dispatch_batches = iterable
    dispatching = bool(dispatch_batches) and world > 1
    if dispatching and (collectives is None or not collectives.active):
        raise ValueError(
            "dispatch_batches=True needs an initialised process group (the run's collectives) to send "
            "every process its batches; set dataloader_config.dispatch_batches=false to let every "
            "process read the data itself"
        )

    return LoaderReading(
        kind=kind, auto_collation=auto_collation, sampler=sampler, sampler_kind=sampler_kind,
        custom_batches=custom_batches, drop_last=drop_last, layout=layout, seed=seed, seed_source=seed_source,
        dispatch_batches=dispatching, is_source=(rank == 0) if is_source is None else is_source,
        loader_kwargs=_rebuild_kwargs(dataloader),
    )


def _rebuild_kwargs(dataloader: DataLoader) -> dict[str, Any]:
    """The user's DataLoader arguments that the rebuilt loaders keep."""
    kwargs: dict[str, Any] = {k: getattr(dataloader, k) for k in LOADER_KWARGS}
    if dataloader.num_workers > 0:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
        kwargs["multiprocessing_context"] = dataloader.multiprocessing_context
    if hasattr(dataloader, "in_order"):
        kwargs["in_order"] = dataloader.in_order
    return kwargs


__all__ = ["LoaderReading", "check_dataloader", "read_user_dataloader"]
