"""The data layer: prepared DataLoaders that shard across data-parallel ranks, own their shuffling
RNG, place batches on the device, report the end of the data and resume mid-epoch exactly.

Accelerate's semantics (``BatchSamplerShard``, ``IterableDatasetShard``, ``DataLoaderDispatcher``,
``skip_first_batches``, ``gather_for_metrics``'s remainder), with these fixes:

* **No global RNG.** Iterating a plain ``DataLoader(shuffle=True)`` draws a seed from the global
  torch RNG on every pass (and another for its worker seeds), so the training RNG stream depends
  on how many passes were made and a resumed run cannot be bit-identical. A prepared loader owns
  its generators: epoch ``e`` is shuffled by ``torch.Generator().manual_seed(seed + e)`` and the
  worker base seed comes from a second generator seeded from ``(seed, e)``. Iterating never
  touches ``torch.get_rng_state()``.
* **Any epoch can be regenerated**, so ``load_state_dict`` resumes by skipping in *index space*
  (no skipped sample is loaded), and a second resume in the same epoch is as exact as the first.
* **Ragged batches dispatch.** With ``dispatch_batches`` rank 0 sends every rank its collated
  batch as a pickled object (``broadcast_object_list``), so variable-length / non-tensor batches
  work (Accelerate concatenates and slices tensors, which crashes on them: accelerate#348).
* **Split before collating.** Sharding and ``even_batches`` padding happen on indices / samples,
  never on collated batches, so any ``collate_fn`` output works.

The shuffling rule (stated once, tested bit-for-bit)
    With ``seed`` resolved as below, the order of epoch ``e`` is exactly
    ``list(RandomSampler(dataset, replacement=..., num_samples=...,
    generator=torch.Generator().manual_seed(seed + e)))`` -- torch's own ``RandomSampler``
    algorithm with a fresh generator per epoch (Accelerate's ``SeedableRandomSampler`` rule). So
    a hand-written ``DataLoader(dataset, batch_size=B, sampler=RandomSampler(dataset,
    generator=torch.Generator().manual_seed(seed + e)))`` yields, on one process, the same
    batches as epoch ``e`` of the prepared loader.

    ``seed`` is, in this order: ``dataloader_config.data_seed``; else ``initial_seed()`` of the
    generator the user gave the DataLoader or its RandomSampler (``generator=``); else one value
    drawn at prepare time from the global torch RNG with
    ``torch.empty((), dtype=torch.int64).random_()`` -- deterministic after ``set_seed`` -- and
    then broadcast from rank 0, so every rank shuffles identically even if some rank consumed
    its global RNG differently before ``prepare`` (a draw, not ``torch.initial_seed()``, so two
    loaders prepared in one run do not shuffle identically).

Samplers
    * ``RandomSampler`` (exactly that class) -> replaced by :class:`SeedableRandomSampler` (the
      rule above). ``use_seedable_sampler`` is therefore always in effect; with
      ``use_configured_sampler=True`` the RandomSampler object is kept instead, but it is still
      driven by the loader's per-epoch generator (see next point), which gives the same order.
    * ``SequentialSampler`` -> kept (``range(n)``, never materialised).
    * any other sampler (subclasses, ``WeightedRandomSampler``, ``SubsetRandomSampler``, your
      own) -> kept; at the start of each pass ``set_epoch(e)`` is called on it if it has one and
      its indices for the epoch are listed; a sampler with a ``generator`` attribute is lent a
      generator seeded with ``seed + e`` for that listing (its own is put back afterwards), so it
      is reproducible, identical on every rank and resumable. A sampler that draws from anything
      else must yield the same indices on every rank (as with Accelerate).
    * a custom ``batch_sampler`` -> its batches are listed per epoch (same lending) and batch
      ``i`` goes to rank ``i % world`` (``split_batches``: every batch is split in ``world`` equal
      parts). A ``torch.utils.data.BatchSampler`` instance is unpacked into its sampler,
      batch size and ``drop_last``, like ``batch_size=``.

Sharding (``world`` = the strategy's ``data_parallel_size``, else the cluster's world size)
    Map-style data is a *global batch sequence*: the epoch's index order cut into global batches
    of ``G = batch_size * world`` (``split_batches``: ``G = batch_size``, each rank ``G/world``).
    Rank ``r``'s ``k``-th batch is positions ``[kG + r*b, kG + (r+1)*b)`` of the order, ``b``
    being the per-rank batch size -- i.e. batch ``i`` of size ``b`` goes to rank ``i % world``
    (Accelerate's ``BatchSamplerShard``). For the last, incomplete global batch (``m < G`` real
    samples):

    * ``drop_last=True``: dropped on every rank;
    * ``even_batches=True`` (default): completed by looping back to the start of the epoch's
      order, so every rank gets the same number of batches of the same size;
    * ``even_batches=False``: only the real samples, so some ranks get a shorter batch or one
      batch fewer (collectives inside the loop must then be guarded); no sample repeats.

    IterableDatasets follow the same layout sample by sample: every chunk of ``G`` samples of the
    stream is one global batch and rank ``r`` takes its slice (Accelerate's
    ``IterableDatasetShard``); a short final chunk is completed from the first samples of the
    stream (``even_batches``), dropped (``drop_last``) or left short. With ``dispatch_batches``
    (the default for IterableDatasets, as in Accelerate; ``False`` for map-style data) only
    global rank 0 iterates the dataset and broadcasts each global batch's per-rank collated parts;
    without it every rank iterates the dataset itself, which must then yield the same samples in
    the same order on every rank. With ``num_workers > 1`` the shard is cut per worker stream
    (each worker iterates its own copy, as in plain torch): there is no duplicate for
    worker-aware datasets, but padding and ``remainder`` then concern each worker's last chunk
    and mid-epoch resume is exact only with ``num_workers <= 1``.

    With one process nothing is sharded; the loader still owns its generator and places batches.

End of data and ``remainder``
    The loader reads one batch ahead, so when it yields its last batch of the pass
    ``gradient_state_of(run).end_of_dataloader`` is already True and ``.remainder`` is the number
    of *real* samples in the global batch that last batch belongs to: ``m`` when the data did
    not divide evenly, the full ``G`` when it did (never 0, so ``gathered[:remainder]`` is always
    right; ``gather`` of the last batch over all ranks, in rank order, puts the real samples
    first). Between batches it is False and ``remainder`` is -1; after the loop ends (or breaks:
    the generator's ``finally``) the loader leaves ``active_dataloaders`` and the flags return
    to those of the enclosing prepared loader, if any.

Position and resume
    ``state_dict()`` is ``{"epoch", "batches_yielded", "samples_yielded",
    "global_batches_yielded", "seed", "world_size", "total_batch_size"}``:
    ``samples_yielded`` counts the real samples of all ranks consumed this epoch (the resume
    position for samples and iterables), ``global_batches_yielded`` the batches of a custom
    batch sampler consumed by all ranks (its resume position), ``batches_yielded`` this rank's
    batches (informational). A state taken on the last batch of an epoch (or after it) is
    ``{epoch: e + 1, 0...}``. ``load_state_dict`` makes the *next* pass resume exactly there:
    map-style data regenerates the epoch's order and starts at that position without loading
    the skipped samples; iterable data replays and discards the consumed samples. Because the
    position is in global samples, a loader at another world size resumes at the *exact same
    global sample* (its batches are then cut from there with its own ``G``); only a custom
    batch sampler resumes at a global batch boundary. The underlying torch loader's own state is
    not recorded: the position above is authoritative and complete for this design, and
    restoring a torchdata ``StatefulDataLoader``'s sampler position on top would skip twice.
    So ``use_stateful_dataloader`` and ``use_seedable_sampler`` need no switch here: every
    prepared loader is seedable and resumable.

Passes and epochs
    Every ``iter(loader)`` is one pass of one epoch and the next ``iter`` runs the next epoch
    (also after a ``break``, like a torch DataLoader), unless ``load_state_dict`` /
    :func:`skip_first_batches` set where the next pass starts. ``set_epoch(e)`` chooses the next
    pass's epoch (keeping a loaded resume position when ``e`` is that position's epoch), calls
    nothing else immediately; at the start of each pass ``set_epoch(e)`` is forwarded to a
    dataset or sampler that has one (HF IterableDatasets reshuffle that way). Iterating one
    loader twice at the same time is not supported (the latest pass owns the position).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from torchrig.collectives import Collectives
from torchrig.config.options import DataLoaderConfiguration
from torchrig.gradient_state import GradientState, gradient_state_of
from torchrig.nested import send_to_device
from torchrig.process import PartialState, world_collectives
from torchrig.runtime import latest_run

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.run import RunContext

_MASK64 = (1 << 64) - 1
#: Mixed into the worker-seed generator's seed so it never equals the shuffling generator's.
_WORKER_SEED_SALT = 0x9E3779B97F4A7C15
_STATE_VERSION = 1


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch ``epoch``'s shuffling generator: ``seed + epoch`` (as a 64-bit value)."""
    return (int(seed) + int(epoch)) & _MASK64


def _worker_seed(seed: int, epoch: int) -> int:
    return ((int(seed) + int(epoch)) ^ _WORKER_SEED_SALT) & _MASK64


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def derive_seed(collectives: Collectives | None = None) -> int:
    """One seed drawn from the global torch RNG, the same on every rank.

    The draw (``torch.empty((), dtype=torch.int64).random_()``) is reproducible after
    ``set_seed``; broadcasting rank 0's value makes it identical on every rank even when ranks
    consumed their global RNG differently before (rank-dependent initialisation, a
    ``device_specific`` seed). Called once, at prepare time, never while iterating.
    """
    seed = int(torch.empty((), dtype=torch.int64).random_().item())
    if collectives is not None and collectives.active:
        seed = int(collectives.broadcast_object_list([seed], src=0)[0])
    return seed


# --------------------------------------------------------------------------------------------
# samplers


class SeedableRandomSampler(Sampler[int]):
    """``RandomSampler`` whose epoch ``e`` is drawn from ``torch.Generator().manual_seed(seed + e)``.

    The algorithm is torch's own (``randperm`` per pass over the data, ``randint`` in chunks of 32
    with replacement), so the indices are bit-identical to a ``RandomSampler`` given that
    generator. Iterating yields the order of ``self.epoch``; :meth:`order` regenerates any epoch
    without touching any other RNG.
    """

    def __init__(
        self, data_source: Any, *, seed: int, replacement: bool = False, num_samples: int | None = None
    ) -> None:
        self.data_source = data_source
        self.seed = int(seed)
        self.replacement = replacement
        self._num_samples = num_samples
        self.epoch = 0

    @property
    def num_samples(self) -> int:
        return len(self.data_source) if self._num_samples is None else self._num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s indices as an int64 tensor of length ``num_samples``."""
        n, count = len(self.data_source), self.num_samples
        generator = _generator(epoch_seed(self.seed, epoch))
        parts: list[torch.Tensor] = []
        if self.replacement:
            for _ in range(count // 32):
                parts.append(torch.randint(high=n, size=(32,), dtype=torch.int64, generator=generator))
            parts.append(torch.randint(high=n, size=(count % 32,), dtype=torch.int64, generator=generator))
        elif n > 0:
            for _ in range(count // n):
                parts.append(torch.randperm(n, generator=generator))
            if count % n:
                parts.append(torch.randperm(n, generator=generator)[: count % n])
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epoch).tolist())

    def __len__(self) -> int:
        return self.num_samples


@contextlib.contextmanager
def _lent_generator(objects: Sequence[Any], seed: int) -> Iterator[None]:
    """Temporarily give every object with a ``generator`` attribute a generator seeded ``seed``."""
    saved: list[tuple[Any, Any]] = []
    try:
        for obj in objects:
            if obj is not None and hasattr(obj, "generator"):
                saved.append((obj, obj.generator))
                obj.generator = _generator(seed)
        yield
    finally:
        for obj, original in reversed(saved):
            obj.generator = original


# --------------------------------------------------------------------------------------------
# the plan: global batches ("rounds") of an epoch, from a start position


@attrs.frozen
class _Layout:
    world: int
    rank: int
    #: Samples per rank batch (``b``); None for a custom batch sampler (sizes vary).
    per_rank: int | None
    split: bool
    even: bool
    drop_last: bool

    @property
    def global_size(self) -> int | None:
        return None if self.per_rank is None else self.per_rank * self.world


@attrs.frozen
class _Meta:
    """What the loader needs to know about one rank batch."""

    #: Index of its global batch within this pass.
    round: int
    #: Real (not repeated) samples in that global batch, all ranks together.
    real_samples: int
    #: Real per-rank batches in that global batch (a custom batch sampler's resume unit).
    real_batches: int
    #: Which rank the batch is for.
    slot: int
    #: How many ranks get a batch of that global batch.
    nparts: int


@attrs.frozen
class _Round:
    index: int
    parts: list[list[Any] | None]
    real_samples: int
    real_batches: int

    @property
    def nparts(self) -> int:
        return sum(part is not None for part in self.parts)


def _take(order: Any, start: int, stop: int) -> list[Any]:
    """``order[start:stop]`` as a list (order: tensor, range or list)."""
    if stop <= start:
        return []
    chunk = order[start:stop]
    return chunk.tolist() if isinstance(chunk, torch.Tensor) else list(chunk)


def _positions(order: Any, n: int, start: int, stop: int) -> list[Any]:
    """Positions ``[start, stop)`` of the epoch, positions ``>= n`` looping back to its start."""
    out = _take(order, start, min(stop, n))
    pos = max(start, n)
    while pos < stop:
        lo = (pos - n) % n
        hi = min(n, lo + (stop - pos))
        out += _take(order, lo, hi)
        pos += hi - lo
    return out


def _index_rounds(order: Any, n: int, start: int, layout: _Layout) -> Iterator[_Round]:
    """The global batches of an index order from global position ``start``."""
    b, world = layout.per_rank, layout.world
    assert b is not None
    g = b * world
    pos, index = start, 0
    while pos < n:
        real = min(g, n - pos)
        if real < g and layout.drop_last:
            return
        pad = real < g and layout.even
        parts: list[list[Any] | None] = []
        for slot in range(world):
            lo, hi = pos + slot * b, pos + (slot + 1) * b
            if pad:
                parts.append(_positions(order, n, lo, hi))
            else:
                part = _take(order, lo, min(hi, n))
                parts.append(part or None)
        yield _Round(index, parts, real, math.ceil(real / b))
        pos += real
        index += 1


def _batch_rounds(batches: Sequence[Sequence[Any]], start: int, layout: _Layout) -> Iterator[_Round]:
    """The global batches of a custom batch sampler's batch list from global batch ``start``."""
    world, nb = layout.world, len(batches)
    if layout.split:
        for index, i in enumerate(range(start, nb)):
            batch = list(batches[i])
            if len(batch) % world:
                raise ValueError(
                    f"split_batches=True: a batch of {len(batch)} samples from the batch sampler cannot be split "
                    f"evenly across {world} processes; its batches must have a multiple of {world} samples"
                )
            k = len(batch) // world
            yield _Round(index, [batch[s * k : (s + 1) * k] for s in range(world)], len(batch), 1)
        return
    pos, index = start, 0
    while pos < nb:
        take = min(world, nb - pos)
        if take < world and layout.drop_last:
            return
        real = [list(batch) for batch in batches[pos : pos + take]]
        parts: list[list[Any] | None] = list(real)
        if take < world:
            if layout.even:
                parts += [list(batches[j % nb]) for j in range(world - take)]
            else:
                parts += [None] * (world - take)
        yield _Round(index, parts, sum(len(batch) for batch in real), take)
        pos += take
        index += 1


class _PlanBatchSampler(Sampler[list[Any]]):
    """The batch sampler of the rebuilt DataLoader: yields the index lists of the current pass.

    It runs in the main process (DataLoader workers only receive indices), so the loader can
    point it at each pass's plan, and it records each batch's :class:`_Meta` in a FIFO that the
    loader pops as batches come out (DataLoader keeps batch order).
    """

    def __init__(self, owner: PreparedDataLoader, single: bool = False) -> None:
        # A weak reference: a cycle would leave the rebuilt loader (and its persistent worker
        # processes) to the garbage collector, whose finalisation order makes worker shutdown
        # wait out torch's 5 s join timeout per worker.
        self._owner = weakref.ref(owner)
        self.single = single
        self.source: Iterator[tuple[list[Any], _Meta]] = iter(())
        self.fifo: collections.deque[_Meta] = collections.deque()

    def __iter__(self) -> Iterator[Any]:
        source, fifo, single = self.source, self.fifo, self.single
        for indices, meta in source:
            fifo.append(meta)
            yield indices[0] if single else indices

    def __len__(self) -> int:
        owner = self._owner()
        return 0 if owner is None else len(owner)


# --------------------------------------------------------------------------------------------
# iterable datasets


class _ShardedIterable(IterableDataset):
    """This rank's slice (``slots=(rank,)``), or every rank's slices in order (dispatch source),
    of every chunk of ``per_rank * world`` samples of ``dataset``, each tagged with its metadata.

    The first ``start`` samples are read and discarded (resume by replay); the first chunk's
    worth of samples of the stream is kept to complete a short final chunk (``even``).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        per_rank: int,
        world: int,
        slots: Sequence[int],
        even: bool,
        drop_last: bool,
        start: int = 0,
    ) -> None:
        self.dataset = dataset
        self.per_rank, self.world, self.slots = per_rank, world, tuple(slots)
        self.even, self.drop_last, self.start = even, drop_last, start

    def _emit(self, chunk: list[Any], real: int, index: int) -> Iterator[tuple[Any, tuple[int, ...]]]:
        b = self.per_rank
        nparts = min(self.world, math.ceil(len(chunk) / b))
        for slot in self.slots:
            tag = (index, real, math.ceil(real / b), slot, nparts)
            for sample in chunk[slot * b : (slot + 1) * b]:
                yield sample, tag

    def __iter__(self) -> Iterator[tuple[Any, tuple[int, ...]]]:
        g = self.per_rank * self.world
        first: list[Any] = []
        chunk: list[Any] = []
        index = 0
        for position, sample in enumerate(self.dataset):
            if len(first) < g:
                first.append(sample)
            if position < self.start:
                continue
            chunk.append(sample)
            if len(chunk) == g:
                yield from self._emit(chunk, g, index)
                chunk, index = [], index + 1
        if chunk and not self.drop_last:
            real = len(chunk)
            if self.even:
                chunk += [first[i % len(first)] for i in range(g - real)]
            yield from self._emit(chunk, real, index)


class _TaggedCollate:
    """Strips the tags off the samples, collates them with the user's ``collate_fn`` (in the
    worker, as usual) and returns ``(batch, tag)``."""

    def __init__(self, collate_fn: Callable[[Any], Any], auto_collation: bool) -> None:
        self.collate_fn, self.auto_collation = collate_fn, auto_collation

    def __call__(self, items: Any) -> tuple[Any, tuple[int, ...]]:
        if not self.auto_collation:
            sample, tag = items
            return self.collate_fn(sample), tag
        return self.collate_fn([sample for sample, _ in items]), items[0][1]


# --------------------------------------------------------------------------------------------
# the prepared loader


@attrs.define
class _Position:
    samples: int = 0
    batches: int = 0
    global_batches: int = 0


@attrs.define(eq=False)
class _Pass:
    epoch: int
    position: _Position
    complete: bool = False
    running: bool = True


_LOADER_KWARGS = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "persistent_workers")


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
        if not isinstance(dataloader, DataLoader):
            raise TypeError(f"prepare(): expected a torch.utils.data.DataLoader, got {type(dataloader).__name__}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not a valid rank of {num_replicas} data-parallel processes")
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
        #: Set while this loader's last batch of a pass is being processed.
        self.end_of_dataloader = False
        #: Real samples of the final global batch (on the last batch), else -1.
        self.remainder = -1
        #: The user's DataLoader's ``batch_size`` (per rank unless ``split_batches``).
        self.batch_size = dataloader.batch_size

        world = num_replicas
        iterable = isinstance(self.dataset, IterableDataset)
        user_batch_sampler = dataloader.batch_sampler
        #: False for ``batch_size=None`` (every sample is a unit, converted, not collated).
        self._auto_collation = user_batch_sampler is not None
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
        self.drop_last = drop_last
        self._kind = "iterable" if iterable else ("batches" if custom_batches is not None else "index")
        self._custom_batches = custom_batches

        per_rank: int | None
        if self._kind == "batches":
            per_rank = None
        else:
            unit = batch_size if self._auto_collation else 1
            assert unit is not None
            if split_batches:
                if not self._auto_collation:
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
        self._layout = _Layout(world, rank, per_rank, split_batches, even_batches and world > 1, drop_last)

        # Seed: config > the user's generator > one draw from the global RNG (module docstring).
        #: Where the seed came from: "config" (data_seed), "generator" (the user's) or "global_rng" (drawn).
        self.seed_source = "config"
        if seed is None:
            user_generator = dataloader.generator or getattr(sampler, "generator", None)
            if user_generator is not None:
                seed = int(user_generator.initial_seed())
                self.seed_source = "generator"
            else:
                self.seed_source = "global_rng"
                # Broadcast even when world == 1: ranks outside data parallelism (tensor/pipeline
                # parallel peers) read the same data and must shuffle it the same way.
                seed = derive_seed(collectives)
        self._seed = int(seed)

        self._sampler_kind = "none"
        if self._kind == "index":
            if type(sampler) is RandomSampler and not use_configured_sampler:
                sampler = SeedableRandomSampler(
                    self.dataset, seed=self._seed, replacement=sampler.replacement, num_samples=sampler._num_samples
                )
                self._sampler_kind = "seedable"
            elif type(sampler) is SequentialSampler:
                self._sampler_kind = "sequential"
            else:
                self._sampler_kind = "custom"
        self.sampler = sampler

        if dispatch_batches is None:
            dispatch_batches = iterable
        self.dispatch_batches = bool(dispatch_batches) and world > 1
        if self.dispatch_batches and (collectives is None or not collectives.active):
            raise ValueError(
                "dispatch_batches=True needs an initialised process group (the run's collectives) to send "
                "every process its batches; set dataloader_config.dispatch_batches=false to let every "
                "process read the data itself"
            )
        self._is_source = (rank == 0) if is_source is None else is_source

        self._loader_kwargs: dict[str, Any] = {k: getattr(dataloader, k) for k in _LOADER_KWARGS}
        if dataloader.num_workers > 0:
            self._loader_kwargs["prefetch_factor"] = dataloader.prefetch_factor
            self._loader_kwargs["multiprocessing_context"] = dataloader.multiprocessing_context
        if hasattr(dataloader, "in_order"):
            self._loader_kwargs["in_order"] = dataloader.in_order
        self._worker_generator = torch.Generator()
        self._map_loader: DataLoader | None = None
        self._plan_sampler: _PlanBatchSampler | None = None
        self._iterable_loader: DataLoader | None = None

        self._next_epoch = 0
        self._pending: _Position | None = None
        self._pass: _Pass | None = None
        self._len_skip = 0
        #: The loader a skip_first_batches copy was made from: the copy's pass is that loader's next pass.
        self._origin: PreparedDataLoader | None = None

    # -- attributes ------------------------------------------------------------------------

    @property
    def seed(self) -> int:
        return self._seed

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
        return self._plan()

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
        return max(0, self._batches_per_epoch() - self._len_skip)

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

    def _current(self) -> tuple[int, _Position]:
        p = self._pass
        if p is not None and not p.complete:
            return p.epoch, p.position
        return self._next_epoch, self._pending or _Position()

    def state_dict(self) -> dict[str, Any]:
        """Where the next pass starts if this state is loaded (module docstring)."""
        epoch, pos = self._current()
        return {
            "version": _STATE_VERSION,
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
        self._pending = _Position(
            samples=int(state_dict.get("samples_yielded", 0)),
            batches=int(state_dict.get("batches_yielded", 0)),
            global_batches=int(state_dict.get("global_batches_yielded", 0)),
        )
        self._pass = None
        self._len_skip = 0

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
        clone._pending = _Position(samples=samples, batches=num_batches, global_batches=global_batches)
        clone._len_skip = num_batches
        clone._origin = self._origin or self
        return clone

    # -- building the torch loaders ----------------------------------------------------------

    def _plan(self) -> _PlanBatchSampler:
        if self._plan_sampler is None:
            self._plan_sampler = _PlanBatchSampler(self, single=not self._auto_collation)
        return self._plan_sampler

    def _rebuilt_map_loader(self) -> DataLoader:
        if self._map_loader is None:
            plan = self._plan()
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
        shard = _ShardedIterable(
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
            collate_fn=_TaggedCollate(self.base_dataloader.collate_fn, self._auto_collation),
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
            order = sampler.order(epoch)
            return order, len(order)
        if self._sampler_kind == "sequential":
            n = len(sampler)
            return range(n), n
        if hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
        with _lent_generator([sampler], epoch_seed(self._seed, epoch)):
            order = list(sampler)
        return order, len(order)

    def _epoch_batches(self, epoch: int) -> list[list[Any]]:
        batches = self._custom_batches
        if hasattr(batches, "set_epoch"):
            batches.set_epoch(epoch)
        with _lent_generator([batches, getattr(batches, "sampler", None)], epoch_seed(self._seed, epoch)):
            return [list(batch) for batch in batches]

    def _map_source(self, p: _Pass, slots: Sequence[int]) -> Iterator[tuple[Any, _Meta]]:
        """(batch, meta) of the map-style pass, for the given slots, from the rebuilt loader."""
        if self._kind == "batches":
            batches = self._epoch_batches(p.epoch)
            start = p.position.global_batches
            p.position.samples = sum(len(batch) for batch in batches[:start])
            rounds = _batch_rounds(batches, start, self._layout)
        else:
            order, n = self._epoch_order(p.epoch)
            rounds = _index_rounds(order, n, p.position.samples, self._layout)

        def plan() -> Iterator[tuple[list[Any], _Meta]]:
            for rnd in rounds:
                for slot in slots:
                    part = rnd.parts[slot]
                    if part is not None:
                        yield part, _Meta(rnd.index, rnd.real_samples, rnd.real_batches, slot, rnd.nparts)

        sampler = self._plan()
        sampler.source = plan()
        sampler.fifo = fifo = collections.deque()
        loader = self._rebuilt_map_loader()
        for batch in loader:
            yield batch, fifo.popleft()

    def _iterable_source(self, p: _Pass, slots: Sequence[int]) -> Iterator[tuple[Any, _Meta]]:
        loader = self._rebuilt_iterable_loader(p.position.samples, slots)
        for batch, tag in loader:
            yield batch, _Meta(*tag)

    def _source(self, p: _Pass, slots: Sequence[int]) -> Iterator[tuple[Any, _Meta]]:
        self._worker_generator.manual_seed(_worker_seed(self._seed, p.epoch))
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(p.epoch)
        if self._kind == "iterable":
            return self._iterable_source(p, slots)
        return self._map_source(p, slots)

    # -- dispatch ----------------------------------------------------------------------------

    def _send(self, message: tuple[Any, ...]) -> None:
        assert self.collectives is not None
        self.collectives.broadcast_object_list([message], src=0)

    def _receive(self) -> tuple[Any, ...]:
        assert self.collectives is not None
        return self.collectives.broadcast_object_list([None], src=0)[0]

    def _source_rounds(self, p: _Pass) -> Iterator[tuple[list[Any], _Meta]]:
        world = self._layout.world
        parts: list[Any] = [None] * world
        count = 0
        for batch, meta in self._source(p, range(world)):
            parts[meta.slot] = batch
            count += 1
            if count == meta.nparts:
                yield parts, meta
                parts, count = [None] * world, 0

    def _dispatched(self, p: _Pass) -> Iterator[tuple[Any, _Meta]]:
        """This rank's batches: rank 0 reads every rank's and broadcasts each global batch.

        One message per global batch, ``("batch", parts, meta, final)``; rank 0 reads one global
        batch ahead to set ``final``, so every rank receives exactly the same messages and stops
        after the final one (no trailing collective to forget); ``("end",)`` for an empty pass;
        ``("error", text)`` when reading failed on rank 0, so the others raise instead of hanging.
        """
        rank = self._layout.rank
        if not self._is_source:
            while True:
                message = self._receive()
                if message[0] == "end":
                    return
                if message[0] == "error":
                    raise RuntimeError(f"the data-loading process (rank 0) failed; its error:\n{message[1]}")
                _, parts, meta, final = message
                mine = parts[rank]
                if mine is None:
                    return
                yield mine, attrs.evolve(meta, slot=rank)
                if final:
                    return
        rounds = self._source_rounds(p)
        try:
            current = next(rounds, None)
        except Exception as exc:
            self._send(("error", f"{type(exc).__name__}: {exc}"))
            raise
        if current is None:
            self._send(("end",))
            return
        while True:
            try:
                following = next(rounds, None)
            except Exception as exc:
                self._send(("error", f"{type(exc).__name__}: {exc}"))
                raise
            parts, meta = current
            self._send(("batch", parts, meta, following is None))
            if parts[rank] is None:
                return
            yield parts[rank], attrs.evolve(meta, slot=rank)
            if following is None:
                return
            current = following

    # -- iteration ---------------------------------------------------------------------------

    def _placed(self, item: tuple[Any, _Meta] | None) -> tuple[Any, _Meta] | None:
        if item is None or self.device is None:
            return item
        return send_to_device(item[0], self.device, self.non_blocking), item[1]

    def _begin_pass(self) -> _Pass:
        epoch = self._next_epoch
        start = self._pending or _Position()
        self._pending = None
        self._next_epoch = epoch + 1
        self._pass = _Pass(epoch=epoch, position=attrs.evolve(start))
        origin = self._origin
        if origin is not None and origin._next_epoch == epoch and not (origin._pass and origin._pass.running):
            # Accelerate's resume pattern: load_state, then iterate skip_first_batches(loader, n) for the rest of
            # the epoch. That pass *is* the original loader's next one: the original shares it (so save_state
            # records the copy's position) and then goes on with the following epoch, not the restored remainder.
            origin._pass, origin._next_epoch, origin._pending = self._pass, epoch + 1, None
        if isinstance(self.sampler, SeedableRandomSampler):
            self.sampler.set_epoch(epoch)
        return self._pass

    def __iter__(self) -> Iterator[Any]:
        return self._iterate()

    def _iterate(self) -> Iterator[Any]:
        p = self._begin_pass()
        state = self.gradient_state
        self.end_of_dataloader, self.remainder = False, -1
        state.enter_dataloader(self)
        items: Iterator[tuple[Any, _Meta]] | None = None
        try:
            items = self._dispatched(p) if self.dispatch_batches else self._source(p, (self._layout.rank,))
            # Batches are placed as soon as they are read, so with non_blocking the copy of the
            # batch read ahead overlaps the step on the current one.
            current = self._placed(next(items, None))
            while current is not None:
                following = self._placed(next(items, None))  # one ahead: is `current` the last?
                batch, meta = current
                position = p.position
                position.samples += meta.real_samples
                position.global_batches += meta.real_batches
                position.batches += 1
                if following is None:
                    p.complete = True
                    self._len_skip = 0
                    self.end_of_dataloader, self.remainder = True, meta.real_samples
                    state.end_of_dataloader, state.remainder = True, meta.real_samples
                yield batch
                if state.step_boundary is not None:  # preemption armed: the step that used `batch` ended
                    state.step_boundary(state.sync_gradients)
                current = following
            p.complete = True
            self._len_skip = 0
        finally:
            p.running = False
            self.end_of_dataloader, self.remainder = False, -1
            if items is not None and hasattr(items, "close"):
                items.close()
            state.exit_dataloader(self)
            outer = state.active_dataloaders[-1] if state.active_dataloaders else None
            state.end_of_dataloader = bool(getattr(outer, "end_of_dataloader", False))
            state.remainder = int(getattr(outer, "remainder", -1))


# --------------------------------------------------------------------------------------------
# entry points


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
        kwargs: dict[str, Any] = {k: getattr(dataloader, k) for k in _LOADER_KWARGS}
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


__all__ = [
    "PreparedDataLoader",
    "SeedableRandomSampler",
    "SkipBatchSampler",
    "derive_seed",
    "epoch_seed",
    "get_sampler",
    "prepare_data_loader",
    "prepare_dataloader",
    "send_to_device",
    "shard_dataloader",
    "skip_first_batches",
]
