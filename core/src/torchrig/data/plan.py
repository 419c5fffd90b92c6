"""The plan of a pass: an epoch's index order (or batch list, or sample stream) cut into global
batches and each rank's part of them, from a start position (the sharding rules of
:mod:`torchrig.data`). Pure bookkeeping on indices: no sample is loaded here."""

from __future__ import annotations

import itertools
import math
import operator
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import attrs
import torch
from torch.utils.data import IterableDataset, Sampler

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.data.loader import PreparedDataLoader


LOADER_KWARGS = ("num_workers", "pin_memory", "timeout", "worker_init_fn", "persistent_workers")
"""The DataLoader arguments a rebuilt loader takes over from the user's."""




@attrs.frozen
class Layout:
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


class BatchMeta(NamedTuple):
    """What the loader needs to know about one rank batch (a tuple: one is made per batch).

    The ``*_done`` fields are cumulative over the pass, so the meta of the last batch handed out
    *is* the loader's position: nothing is added up per batch."""

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
    #: Real samples of all ranks consumed in this pass once this global batch is done.
    samples_done: int
    #: Per-rank batches of all ranks consumed in this pass once this global batch is done.
    global_batches_done: int
    #: Whether it is the last batch of the pass for ``slot`` (False where the source cannot know
    #: yet: a stream; the loader's look-ahead marks it then).
    last: bool


def _take(order: Any, start: int, stop: int) -> list[Any]:
    """``order[start:stop]`` as a list (order: list, range or 1-D int64 tensor)."""
    if stop <= start:
        return []
    chunk = order[start:stop]
    if type(chunk) is list:
        return chunk
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


def _tail(order: Any, n: int, pos: int, layout: Layout) -> list[list[Any] | None]:
    """Every rank's part of the last, incomplete global batch (padded when ``layout.even``)."""
    b = layout.per_rank
    assert b is not None
    parts: list[list[Any] | None] = []
    for slot in range(layout.world):
        lo, hi = pos + slot * b, pos + (slot + 1) * b
        parts.append(_positions(order, n, lo, hi) if layout.even else (_take(order, lo, min(hi, n)) or None))
    return parts


def _full_parts(order: Any, start: int, full: int, b: int, world: int, slots: Sequence[int]) -> Iterator[list[Any]]:
    """The given ranks' batches of the ``full`` complete global batches after ``start``: rank
    r's batch k is positions ``[k*g + r*b, k*g + (r+1)*b)``. Cut by C code: a tensor order
    becomes every batch's list in one ``tolist`` (of these ranks' indices only), a list or range
    is sliced lazily by C iterators — no Python frame per batch."""
    g = b * world
    if full <= 0:
        return iter(())
    if isinstance(order, torch.Tensor):
        order = order.contiguous()
        if len(slots) == 1:  # one rank's pass (the usual case): a (full, b) view, rows g apart
            rows = order.as_strided((full, b), (g, 1), order.storage_offset() + start + slots[0] * b)
            return iter(rows.tolist())
        return iter(order[start:start + full * g].view(full, world, b)[:, list(slots)].reshape(-1, b).tolist())
    firsts: Sequence[int] = (range(start + slots[0] * b, start + full * g, g) if len(slots) == 1
                             else [lo + slot * b for lo in range(start, start + full * g, g) for slot in slots])
    cuts = map(order.__getitem__, map(slice, firsts, map(operator.add, firsts, itertools.repeat(b))))
    return cuts if type(order) is list else map(list, cuts)  # a range's slices are ranges


class PassPlan:
    """One pass's batches for the given slots: their index lists (``parts``, in the order the
    loader takes them), how many there are (``count``), and the :class:`BatchMeta` of the k-th,
    worked out when asked (:meth:`meta`) — so a pass hands batches out without making a meta per
    batch, and its position is just the number it handed out.

    The complete global batches follow one rule (``full`` rounds of ``g`` samples, each slot's
    part in turn); what is left (a short final global batch, a custom sampler's batches) is
    ``listed``."""

    __slots__ = ("parts", "count", "_full", "_g", "_world", "_slots", "_final", "_listed")

    def __init__(self, parts: Iterator[list[Any]], *, slots: Sequence[int], world: int, full: int = 0, g: int = 0,
                 final: Sequence[int] = (), listed: Sequence[BatchMeta] = ()) -> None:
        self.parts = parts
        self._full, self._g, self._world, self._slots, self._final = full, g, world, tuple(slots), final
        self._listed = listed
        self.count = full * len(self._slots) + len(listed)

    def meta(self, k: int) -> BatchMeta:
        """The meta of the plan's k-th batch (0-based)."""
        m = len(self._slots)
        if k >= self._full * m:
            return self._listed[k - self._full * m]
        index, i = divmod(k, m)
        slot, done, g, world = self._slots[i], index + 1, self._g, self._world
        return BatchMeta(index, g, world, slot, world, done * g, done * world, index == self._final[slot])

    def metas(self) -> Iterator[BatchMeta]:
        """Every batch's meta, in order (for passes that keep each batch's meta)."""
        return map(self.meta, range(self.count))


def index_parts(order: Any, n: int, start: int, layout: Layout, slots: Sequence[int]) -> PassPlan:
    """The plan of the given ranks' batches of an index order from global position ``start``
    (the hot path of a map-style pass: C iterators, one ``tolist`` per pass for a shuffled
    order)."""
    b, world = layout.per_rank, layout.world
    assert b is not None
    g = b * world
    full = max(0, (n - start) // g)
    real = n - start - full * g
    tail = _tail(order, n, start + full * g, layout) if real > 0 and not layout.drop_last else None
    # The round of each rank's last batch: the tail's, if the rank has a part of it.
    final = [full if tail is not None and tail[slot] is not None else full - 1 for slot in range(world)]
    parts = _full_parts(order, start, full, b, world, slots)
    if tail is None:
        return PassPlan(parts, slots=slots, world=world, full=full, g=g, final=final)
    nparts, real_batches = len(tail) - tail.count(None), math.ceil(real / b)
    ends = [slot for slot in slots if tail[slot] is not None]
    listed = [BatchMeta(full, real, real_batches, slot, nparts, full * g + real, full * world + real_batches, True)
              for slot in ends]
    return PassPlan(itertools.chain(parts, [tail[slot] for slot in ends]), slots=slots, world=world, full=full, g=g,
                    final=final, listed=listed)


def batch_parts(batches: Sequence[Sequence[Any]], start: int, layout: Layout, slots: Sequence[int]) -> PassPlan:
    """The plan of the given ranks' batches of a custom batch sampler's batch list from global
    batch ``start`` (the list is the epoch's, already read: the plan is made whole, and a batch
    that ``split_batches`` cannot split is refused before the pass hands out any)."""
    parts: list[list[Any]] = []
    metas: list[BatchMeta] = []
    world, nb = layout.world, len(batches)
    done = 0
    if layout.split:
        for index, i in enumerate(range(start, nb)):
            batch = list(batches[i])
            if len(batch) % world:
                raise ValueError(
                    f"split_batches=True: batch {i} of the batch sampler has {len(batch)} samples, which cannot be "
                    f"split evenly across {world} processes; its batches must have a multiple of {world} samples"
                )
            k, done = len(batch) // world, done + len(batch)
            for slot in slots:
                metas.append(BatchMeta(index, len(batch), 1, slot, world, done, index + 1, i == nb - 1))
                parts.append(batch[slot * k : (slot + 1) * k])
        return PassPlan(iter(parts), slots=slots, world=world, listed=metas)
    remaining = max(0, nb - start)
    full, rest = divmod(remaining, world)
    tail = rest > 0 and not layout.drop_last
    # The round of each rank's last batch: the short final round's, if the rank has a part of it.
    final = [full if tail and (slot < rest or layout.even) else full - 1 for slot in range(world)]
    pos, index = start, 0
    while pos < nb:
        take = min(world, nb - pos)
        if take < world and layout.drop_last:
            break
        real = [list(batch) for batch in batches[pos : pos + take]]
        round_parts: list[list[Any] | None] = list(real)
        if take < world:
            if layout.even:
                round_parts += [list(batches[j % nb]) for j in range(world - take)]
            else:
                round_parts += [None] * (world - take)
        real_samples, nparts = sum(len(batch) for batch in real), len(round_parts) - round_parts.count(None)
        done += real_samples
        for slot in slots:
            part = round_parts[slot]
            if part is not None:
                metas.append(BatchMeta(index, real_samples, take, slot, nparts, done, index * world + take,
                                       index == final[slot]))
                parts.append(part)
        pos += take
        index += 1
    return PassPlan(iter(parts), slots=slots, world=world, listed=metas)


class PlanBatchSampler(Sampler[list[Any]]):
    """The batch sampler of the rebuilt DataLoader: yields the index lists of the current pass.

    It runs in the main process (DataLoader workers only receive indices), so the loader can
    point it at each pass's plan's index lists (:class:`PassPlan`; DataLoader keeps their order,
    so the k-th batch out is the plan's k-th). No frame of its own per batch: iterating it is
    iterating the plan's parts.
    """

    def __init__(self, owner: PreparedDataLoader, single: bool = False) -> None:
        # A weak reference: a cycle would leave the rebuilt loader (and its persistent worker
        # processes) to the garbage collector, whose finalisation order makes worker shutdown
        # wait out torch's 5 s join timeout per worker.
        self._owner = weakref.ref(owner)
        self.single = single
        self.source: Iterator[list[Any]] = iter(())

    def __iter__(self) -> Iterator[Any]:
        return map(operator.itemgetter(0), self.source) if self.single else self.source

    def __len__(self) -> int:
        owner = self._owner()
        return 0 if owner is None else len(owner)




class ShardedIterable(IterableDataset):
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


class TaggedCollate:
    """Strips the tags off the samples, collates them with the user's ``collate_fn`` (in the
    worker, as usual) and returns ``(batch, tag)``."""

    def __init__(self, collate_fn: Callable[[Any], Any], auto_collation: bool) -> None:
        self.collate_fn, self.auto_collation = collate_fn, auto_collation

    def __call__(self, items: Any) -> tuple[Any, tuple[int, ...]]:
        if not self.auto_collation:
            sample, tag = items
            return self.collate_fn(sample), tag
        return self.collate_fn([sample for sample, _ in items]), items[0][1]


__all__ = ["LOADER_KWARGS", "BatchMeta", "Layout", "PassPlan", "PlanBatchSampler", "ShardedIterable", "TaggedCollate", "batch_parts", "index_parts"]
