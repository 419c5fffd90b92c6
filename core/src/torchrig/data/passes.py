"""The state of one pass of a prepared loader: where it started, the meta of the last batch it
handed out (from which its position and end-of-data flags are read), and how it ends."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, NamedTuple

from torchrig.data.plan import BatchMeta

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.data.loader import PreparedDataLoader


class Position(NamedTuple):
    """Where a pass stands (or starts) in its epoch: samples of all ranks, this rank's batches,
    per-rank batches of all ranks. Immutable: a pass may start from a shared one."""

    samples: int = 0
    batches: int = 0
    global_batches: int = 0


EPOCH_START = Position()


class Pass:
    """One pass of a prepared loader (``__slots__``: one is made per epoch, on the hot path)."""

    __slots__ = ("epoch", "start", "delivered", "complete", "running")

    def __init__(self, epoch: int, start: Position) -> None:
        self.epoch = epoch
        #: Where the pass started.
        self.start = start
        #: The meta of the last batch handed out (filled from C code on the fast path).
        self.delivered: collections.deque[BatchMeta] = collections.deque(maxlen=1)
        self.complete = False
        self.running = True

    @property
    def position(self) -> Position:
        """Where the next batch would start: ``start`` plus the cumulative meta of the last one."""
        if not self.delivered:
            return self.start
        meta, start = self.delivered[0], self.start
        return Position(start.samples + meta.samples_done, start.batches + meta.round + 1,
                        start.global_batches + meta.global_batches_done)

    @property
    def finished(self) -> bool:
        """Exhausted, or its last batch handed out (a state taken now belongs to the next epoch)."""
        return self.complete or (bool(self.delivered) and self.delivered[0].last)


class PassEnd:
    """The last link of a fast pass's iterator chain: ``next`` on it (once the batches ran out)
    completes the pass; when the chain is dropped first (a ``break``, an error), its finaliser
    ends the pass as incomplete — what a generator's ``finally`` does on the other path."""

    __slots__ = ("loader", "pass_", "open")

    def __init__(self, loader: PreparedDataLoader, pass_: Pass) -> None:
        self.loader, self.pass_, self.open = loader, pass_, True

    def __iter__(self) -> PassEnd:
        return self

    def __next__(self) -> Any:
        self.close(complete=True)
        raise StopIteration

    def close(self, complete: bool = False) -> None:
        if not self.open:
            return
        self.open = False
        if complete:
            self.pass_.complete = True
        if self.pass_.finished:  # also after a break on the last batch: a skip covers one pass only
            self.loader._len_skip = 0
        self.pass_.running = False
        self.loader.gradient_state.exit_dataloader(self.loader)

    def __del__(self) -> None:
        self.close()


__all__ = ["EPOCH_START", "Pass", "PassEnd", "Position"]
