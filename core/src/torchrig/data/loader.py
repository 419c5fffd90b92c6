"""The prepared loader: runs a pass of the plan through a rebuilt torch DataLoader, places
batches, keeps the resume position and the end-of-data flags.

The hot path is :meth:`PreparedDataLoader._fast_pass` (map-style data, batches already where
they belong, no preemption armed): the batches come out of torch's loader iterator through C
iterators only, each batch's number lands in the pass's ``delivered`` as the batch is handed
out, and the position and end-of-data flags are worked out from that number by the pass's
plan when asked — no frame of torchrig's and no object of its own per batch. Every other pass
runs :meth:`PreparedDataLoader._iterate`, a generator that reads one batch ahead (streams: to
know the last one; devices: to overlap the copy), places batches and stops at preemption's
step boundaries."""

from __future__ import annotations

import copy
import itertools
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch.utils.data import DataLoader

from torchrig.data.construction import check_dataloader, read_user_dataloader
from torchrig.data.dispatch import dispatched
from torchrig.data.passes import EPOCH_START, Pass, PassEnd, Position
from torchrig.data.plan import (
    BatchMeta,
    PassPlan,
    PlanBatchSampler,
    ShardedIterable,
    TaggedCollate,
    batch_parts,
    index_parts,
)
from torchrig.data.seeding import (
    STATE_VERSION,
    SeedableRandomSampler,
    epoch_seed,
    lent_generator,
    worker_seed,
)
from torchrig.distributed.nested import send_to_device
from torchrig.training.gradient_state import GradientState

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.distributed.collectives import Collectives


class PreparedDataLoader:
    """A DataLoader sharded for this rank, shuffled by its own generator, device-placing,
    end-of-data aware and resumable mid-epoch (module docstring: the rules).

    Built by :func:`prepare_dataloader` (from the run's configuration) or
    :func:`shard_dataloader`; the arguments mirror ``dataloader_config``.

    Attributes: ``dataset``, ``batch_size`` (the user's), ``sampler`` (the
    :class:`SeedableRandomSampler` that replaced a RandomSampler, else the user's), ``batch_sampler``
    (the rebuilt loader's), ``collate_fn``, ``total_batch_size`` (one global batch),
    ``total_dataset_length``, ``num_processes``/``process_index`` (data-parallel), ``seed``,
    ``epoch``, ``end_of_dataloader``/``remainder`` (this loader's flags), ``base_dataloader`` (the
    user's DataLoader, to which any other attribute is delegated). ``len()`` is this rank's
    batches per epoch. Methods: ``set_epoch``, ``state_dict``, ``load_state_dict``.
    """

    def __init__(
        self,
        dataloader: DataLoader,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        device: torch.device | str | None = None,
        non_blocking: bool = False,
        split_batches: bool = False,
        even_batches: bool = True,
        dispatch_batches: bool | None = None,
        seed: int | None = None,
        use_configured_sampler: bool = False,
        collectives: Collectives | None = None,
        is_source: bool | None = None,
        gradient_state: GradientState | None = None,
    ) -> None:
        check_dataloader(dataloader, num_replicas, rank)
        self.base_dataloader = dataloader
        self.dataset = dataloader.dataset
        self.device = torch.device(device) if device is not None else None
        self.non_blocking = non_blocking
        self.num_processes = num_replicas
        self.process_index = rank
        self.split_batches = split_batches
        self._even_batches = bool(even_batches)
        self.collectives = collectives
        self.gradient_state = gradient_state if gradient_state is not None else GradientState()
        #: The user's DataLoader's ``batch_size`` (per rank unless ``split_batches``).
        self.batch_size = dataloader.batch_size

        reading = read_user_dataloader(
            dataloader, num_replicas=num_replicas, rank=rank, split_batches=split_batches, even_batches=even_batches,
            dispatch_batches=dispatch_batches, seed=seed, use_configured_sampler=use_configured_sampler,
            collectives=collectives, is_source=is_source,
        )
        # What to batch and how (``_auto_collation`` False: batch_size=None, every sample a unit).
        self._kind, self._custom_batches, self._auto_collation = reading.kind, reading.custom_batches, reading.auto_collation
        self.drop_last, self._layout = reading.drop_last, reading.layout
        #: Where the seed came from: "config" (data_seed), "generator" (the user's) or "global_rng" (drawn).
        self.seed_source = reading.seed_source
        self._seed, self.sampler, self._sampler_kind = reading.seed, reading.sampler, reading.sampler_kind
        self.dispatch_batches, self._is_source = reading.dispatch_batches, reading.is_source
        self._loader_kwargs = reading.loader_kwargs
        self._worker_generator = torch.Generator()
        #: Called with each pass's epoch (HF datasets reshuffle that way); looked up once.
        self._dataset_set_epoch = getattr(self.dataset, "set_epoch", None)
        self._map_loader: DataLoader | None = None
        self._plan_sampler: PlanBatchSampler | None = None
        self._iterable_loader: DataLoader | None = None

        self._next_epoch = 0
        self._pending: Position | None = None
        self._pass: Pass | None = None
        self._len_skip = 0
        #: The loader a skip_first_batches copy was made from: the copy's pass is that loader's next pass.
        self._origin: PreparedDataLoader | None = None
        #: ``(epoch, batch)`` positions never handed out (:meth:`skip_batches`).
        self._skipped_batches: frozenset[tuple[int, int]] = frozenset()

    # -- attributes ------------------------------------------------------------------------

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def end_of_dataloader(self) -> bool:
        """True while this loader's last batch of a pass is being processed."""
        p = self._pass
        return p is not None and p.running and p.at_last_batch()

    @property
    def remainder(self) -> int:
        """Real samples of the final global batch (on the last batch), else -1."""
        return self._pass.last().real_samples if self.end_of_dataloader else -1  # type: ignore[union-attr]

    @property
    def epoch(self) -> int:
        """The epoch of the pass in progress, else of the next pass."""
        if self._pass is not None and self._pass.running:
            return self._pass.epoch
        return self._next_epoch

    @property
    def total_batch_size(self) -> int | None:
        """Samples in one global batch (all ranks together)."""
        g = self._layout.global_size
        if g is not None:
            return g
        size = getattr(self._custom_batches, "batch_size", None)
        return None if size is None else size * (1 if self.split_batches else self.num_processes)

    @property
    def total_dataset_length(self) -> int:
        if hasattr(self.dataset, "total_length"):
            return self.dataset.total_length
        return len(self.dataset)

    @property
    def collate_fn(self) -> Any:
        return self.base_dataloader.collate_fn

    @property
    def batch_sampler(self) -> Any:
        """The rebuilt loader's batch sampler (map-style data; the user's for iterables)."""
        if self._kind == "iterable":
            return self.base_dataloader.batch_sampler
        return self._plan_batch_sampler()

    def __getattr__(self, name: str) -> Any:
        if name == "base_dataloader" or name.startswith("__"):  # unset during unpickling / copying
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)

    @property
    def even_batches(self) -> bool:
        """Whether ranks get equally many, equally sized batches (padding from the epoch start);
        settable between passes (``Accelerator.join_uneven_inputs(even_batches=False)``)."""
        return self._even_batches

    @even_batches.setter
    def even_batches(self, value: bool) -> None:
        self._even_batches = bool(value)
        if "_layout" in self.__dict__:
            self._layout = attrs.evolve(self._layout, even=self._even_batches and self._layout.world > 1)

    def __len__(self) -> int:
        """This rank's batches in one epoch (minus the batches a pending
        :func:`skip_first_batches` will skip, as in Accelerate)."""
        skip = self._len_skip
        if skip and self._pass is not None and self._pass.finished:  # the skipping pass is over
            skip = 0
        return max(0, self._batches_per_epoch() - skip)

    def _epoch_length(self) -> int:
        return len(self.dataset) if self._kind == "iterable" else len(self.sampler)

    def _batches_per_epoch(self) -> int:
        layout = self._layout
        world, rank = layout.world, layout.rank
        if self._kind == "batches":
            nb = len(self._custom_batches)
            if layout.split:
                return nb
            q, k = divmod(nb, world)
            return q + (1 if k and not layout.drop_last and (layout.even or rank < k) else 0)
        n, b = self._epoch_length(), layout.per_rank
        assert b is not None
        q, m = divmod(n, b * world)
        return q + (1 if m and not layout.drop_last and (layout.even or rank * b < m) else 0)

    # -- epochs and position ---------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next pass runs (a pending resume in that same epoch is kept)."""
        if self._pending is not None and self._next_epoch != epoch:
            self._pending = None
        self._next_epoch = int(epoch)
        if self._pass is not None and not self._pass.running:
            self._pass = None

    def _current(self) -> tuple[int, Position]:
        p = self._pass
        if p is not None and not p.finished:
            return p.epoch, p.position
        return self._next_epoch, self._pending or EPOCH_START

    def state_dict(self) -> dict[str, Any]:
        """Where the next pass starts if this state is loaded (module docstring)."""
        epoch, pos = self._current()
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "batches_yielded": pos.batches,
            "samples_yielded": pos.samples,
            "global_batches_yielded": pos.global_batches,
            "seed": self._seed,
            "world_size": self.num_processes,
            "total_batch_size": self.total_batch_size,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Make the next pass resume exactly at ``state_dict``'s position (and seed)."""
        self._seed = int(state_dict["seed"])
        if isinstance(self.sampler, SeedableRandomSampler):
            self.sampler.seed = self._seed
        self._next_epoch = int(state_dict["epoch"])
        self._pending = Position(
            samples=int(state_dict.get("samples_yielded", 0)),
            batches=int(state_dict.get("batches_yielded", 0)),
            global_batches=int(state_dict.get("global_batches_yielded", 0)),
        )
        self._pass = None
        self._len_skip = 0

    def skip_batches(self, positions: Iterable[tuple[int, int]]) -> None:
        """Never hand out the batches at these ``(epoch, batch number in the epoch)`` positions, on any
        pass: the training guard's rollback replays the data stream without the batches of a bad step.
        Every data-parallel rank skips its batch of that number, so the ranks stay in step; the
        position moves past a skipped batch as if it had been handed out."""
        self._skipped_batches = frozenset((int(epoch), int(batch)) for epoch, batch in positions)

    @property
    def resume_origin(self) -> PreparedDataLoader:
        """The prepared loader this one stands for: itself, or the one a skip_first_batches copy was made from."""
        return self._origin or self

    def last_batch_position(self) -> tuple[int, int] | None:
        """``(epoch, batch number in the epoch)`` of the batch handed out last, None before the first."""
        p = self._pass
        if p is None or not p.delivered:
            return None
        return p.epoch, p.position.batches - 1

    def _skipped(self, num_batches: int) -> PreparedDataLoader:
        """A copy whose next pass starts ``num_batches`` of this rank's batches into the epoch."""
        clone = copy.copy(self)
        clone._map_loader = clone._plan_sampler = clone._iterable_loader = None
        clone._worker_generator = torch.Generator()
        clone._pass = None
        if isinstance(self.sampler, SeedableRandomSampler):  # its seed may be reloaded: not shared
            clone.sampler = copy.copy(self.sampler)
        layout = self._layout
        if self._kind == "batches":
            global_batches = num_batches if layout.split else num_batches * layout.world
            samples = 0  # computed from the batch list when the pass starts
        else:
            assert layout.global_size is not None and layout.per_rank is not None
            samples = num_batches * layout.global_size
            global_batches = num_batches * layout.world
        clone._pending = Position(samples=samples, batches=num_batches, global_batches=global_batches)
        clone._len_skip = num_batches
        clone._origin = self._origin or self
        return clone

    # -- building the torch loaders ----------------------------------------------------------

    def _plan_batch_sampler(self) -> PlanBatchSampler:
        if self._plan_sampler is None:
            self._plan_sampler = PlanBatchSampler(self, single=not self._auto_collation)
        return self._plan_sampler

    def _rebuilt_map_loader(self) -> DataLoader:
        if self._map_loader is None:
            plan = self._plan_batch_sampler()
            common = dict(
                collate_fn=self.base_dataloader.collate_fn, generator=self._worker_generator, **self._loader_kwargs
            )
            if self._auto_collation:
                self._map_loader = DataLoader(self.dataset, batch_sampler=plan, **common)
            else:
                self._map_loader = DataLoader(self.dataset, batch_size=None, sampler=plan, **common)
        return self._map_loader

    def _rebuilt_iterable_loader(self, start: int, slots: Sequence[int]) -> DataLoader:
        persistent = self._loader_kwargs["persistent_workers"]
        if persistent and start == 0 and self._iterable_loader is not None:
            return self._iterable_loader
        layout = self._layout
        assert layout.per_rank is not None
        shard = ShardedIterable(
            self.dataset,
            per_rank=layout.per_rank,
            world=layout.world,
            slots=slots,
            even=layout.even,
            drop_last=layout.drop_last,
            start=start,
        )
        loader = DataLoader(
            shard,
            batch_size=layout.per_rank if self._auto_collation else None,
            collate_fn=TaggedCollate(self.base_dataloader.collate_fn, self._auto_collation),
            generator=self._worker_generator,
            **self._loader_kwargs,
        )
        if persistent and start == 0:
            self._iterable_loader = loader
        return loader

    # -- epoch plans -----------------------------------------------------------------------------

    def _epoch_order(self, epoch: int) -> tuple[Any, int]:
        sampler = self.sampler
        if self._sampler_kind == "seedable":
            order = sampler.order(epoch)  # a tensor: the plan makes Python ints of this rank's part only
            return order, order.shape[0]
        if self._sampler_kind == "sequential":
            n = len(sampler)
            return range(n), n
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        with lent_generator([sampler], epoch_seed(self._seed, epoch)):
            order = list(sampler)
        return order, len(order)

    def _epoch_batches(self, epoch: int) -> list[list[Any]]:
        batches = self._custom_batches
        if hasattr(batches, "set_epoch"):
            batches.set_epoch(epoch)
        with lent_generator([batches, getattr(batches, "sampler", None)], epoch_seed(self._seed, epoch)):
            return [list(batch) for batch in batches]

    def _map_batches(self, p: Pass, slots: Sequence[int]) -> tuple[Iterator[Any], PassPlan]:
        """The map-style pass's batches for the given slots (the rebuilt loader's iterator over
        the plan's index lists) and its plan, whose k-th meta is the k-th batch's (DataLoader
        keeps the order, with workers too)."""
        if self._kind == "batches":
            batches = self._epoch_batches(p.epoch)
            start = p.start.global_batches
            p.start = p.start._replace(samples=sum(len(batch) for batch in batches[:start]))
            plan = batch_parts(batches, start, self._layout, slots)
        else:
            order, n = self._epoch_order(p.epoch)
            plan = index_parts(order, n, p.start.samples, self._layout, slots)
        self._plan_batch_sampler().source = plan.parts
        return iter(self._rebuilt_map_loader()), plan

    def _iterable_source(self, p: Pass, slots: Sequence[int]) -> Iterator[tuple[Any, BatchMeta]]:
        loader = self._rebuilt_iterable_loader(p.start.samples, slots)
        layout = self._layout
        assert layout.per_rank is not None
        g, world = layout.per_rank * layout.world, layout.world
        for batch, (index, real, real_batches, slot, nparts) in loader:
            # Every chunk before this one was full; the stream's last is known only by reading past it.
            yield batch, BatchMeta(index, real, real_batches, slot, nparts, index * g + real,
                                   index * world + real_batches, False)

    def _prepare_source(self, p: Pass) -> None:
        if self._loader_kwargs["num_workers"]:  # the workers' base seed; unused by a single-process pass
            self._worker_generator.manual_seed(worker_seed(self._seed, p.epoch))
        if self._dataset_set_epoch is not None:
            self._dataset_set_epoch(p.epoch)

    def _source(self, p: Pass, slots: Sequence[int]) -> Iterator[tuple[Any, BatchMeta]]:
        self._prepare_source(p)
        if self._kind == "iterable":
            return self._iterable_source(p, slots)
        batches, plan = self._map_batches(p, slots)
        return zip(batches, plan.metas())

    # -- iteration ---------------------------------------------------------------------------

    def _begin_pass(self) -> Pass:
        epoch = self._next_epoch
        start = self._pending
        self._pending = None
        self._next_epoch = epoch + 1
        self._pass = Pass(epoch, EPOCH_START if start is None else start)
        origin = self._origin
        if origin is not None and origin._next_epoch == epoch and not (origin._pass and origin._pass.running):
            # Accelerate's resume pattern: load_state, then iterate skip_first_batches(loader, n) for the rest of
            # the epoch. That pass *is* the original loader's next one: the original shares it (so save_state
            # records the copy's position) and then goes on with the following epoch, not the restored remainder.
            origin._pass, origin._next_epoch, origin._pending = self._pass, epoch + 1, None
        if isinstance(self.sampler, SeedableRandomSampler):
            self.sampler.set_epoch(epoch)
        return self._pass

    def _placement(self) -> torch.device | None:
        """Where batches are moved, or None: a DataLoader's batches are in CPU memory, so on a CPU
        run there is nothing to move and nothing is walked per batch."""
        return self.device if self.device is not None and self.device.type != "cpu" else None

    def __iter__(self) -> Iterator[Any]:
        if (self._kind != "iterable" and not self.dispatch_batches and self._placement() is None
                and self.gradient_state.step_boundary is None and not self._skipped_batches):
            return self._fast_pass()
        return self._iterate()

    def _fast_pass(self) -> Iterator[Any]:
        """One map-style pass of batches that need no placement, with no step boundary to keep:
        torch's loader iterator, each batch's number appended to the pass's ``delivered`` (C
        calls) as the batch is handed out, and :class:`PassEnd` to close the pass."""
        p = self._begin_pass()
        self.gradient_state.enter_dataloader(self)
        end = PassEnd(self, p)
        try:
            self._prepare_source(p)
            batches, plan = self._map_batches(p, (self._layout.rank,))
        except BaseException:
            end.close()
            raise
        p.plan = plan  # a counted pass: each batch's number lands in `delivered` as it is handed out
        handed = zip(batches, map(p.delivered.append, itertools.count(1)))
        return itertools.chain(map(_batch_of, handed), end)

    def _iterate(self) -> Iterator[Any]:
        p = self._begin_pass()
        state = self.gradient_state
        state.enter_dataloader(self)
        items: Iterator[tuple[Any, BatchMeta]] | None = None
        try:
            items = (
                dispatched(self.collectives, self._layout.rank, self._layout.world, self._is_source,
                           lambda: self._source(p, range(self._layout.world)))
                if self.dispatch_batches
                else self._source(p, (self._layout.rank,))
            )
            if self._skipped_batches:
                items = _without_positions(items, p.epoch, p.start.batches, self._skipped_batches)
            # Batches are placed as soon as they are read, so with non_blocking the copy of the
            # batch read ahead overlaps the step on the current one.
            device = self._placement()
            non_blocking = self.non_blocking
            delivered = p.delivered
            current = next(items, None)
            if current is not None and device is not None:
                current = send_to_device(current[0], device, non_blocking), current[1]
            while current is not None:
                following = next(items, None)  # one ahead: is `current` the last?
                if following is not None and device is not None:
                    following = send_to_device(following[0], device, non_blocking), following[1]
                batch, meta = current
                if following is None:
                    p.complete = True
                    self._len_skip = 0
                    if not meta.last:
                        meta = meta._replace(last=True)
                delivered.append(meta)
                yield batch
                if state.step_boundary is not None:  # preemption armed: the step that used `batch` ended
                    state.step_boundary(state.sync_gradients)
                current = following
            p.complete = True
            self._len_skip = 0
        finally:
            p.running = False
            if items is not None and hasattr(items, "close"):
                items.close()
            state.exit_dataloader(self)


_batch_of = operator.itemgetter(0)


def _without_positions(items: Iterator[tuple[Any, BatchMeta]], epoch: int, first: int,
                       skipped: frozenset[tuple[int, int]]) -> Iterator[tuple[Any, BatchMeta]]:
    """``items`` less the batches whose ``(epoch, first + round)`` is skipped; closes ``items`` when closed."""
    try:
        for item in items:
            if (epoch, first + item[1].round) not in skipped:
                yield item
    finally:
        if hasattr(items, "close"):
            items.close()


__all__ = ["PreparedDataLoader"]
