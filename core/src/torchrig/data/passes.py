"""The state of one pass of a prepared loader: where it started, the last batch it handed out
(its meta, or its number on a counted pass, from which its position and end-of-data flags are
worked out), and how it ends."""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, NamedTuple

from torchrig.data.plan import BatchMeta, PassPlan

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
    """One pass of a prepared loader (``__slots__``: one is made per epoch, on the hot path).

    ``delivered`` holds what is known of the last batch handed out: its :class:`BatchMeta`, or —
    on a counted pass (``plan`` set: the fast path) — its number, whose meta the plan works out
    when asked."""

    __slots__ = ("epoch", "start", "delivered", "plan", "complete", "running")

    def __init__(self, epoch: int, start: Position) -> None:
        self.epoch = epoch
        #: Where the pass started.
        self.start = start
        #: The last batch handed out: its meta, or its number (1-based) on a counted pass; filled
        #: from C code on the fast path.
        self.delivered: collections.deque[Any] = collections.deque(maxlen=1)
        self.plan: PassPlan | None = None
        self.complete = False
        self.running = True

    def last(self) -> BatchMeta | None:
        """The meta of the last batch handed out, if any."""
        if not self.delivered:
            return None
        item = self.delivered[0]
        return item if self.plan is None else self.plan.meta(item - 1)

    def at_last_batch(self) -> bool:
        """Whether the last batch handed out is this rank's last of the pass (read every step)."""
        delivered = self.delivered
        if not delivered:
            return False
        plan = self.plan
        # A counted pass is one rank's: its last batch is the plan's last.
        return delivered[0] == plan.count if plan is not None else delivered[0].last

    @property
    def position(self) -> Position:
        """Where the next batch would start: ``start`` plus the cumulative meta of the last one."""
        meta = self.last()
        if meta is None:
            return self.start
        start = self.start
        return Position(start.samples + meta.samples_done, start.batches + meta.round + 1,
                        start.global_batches + meta.global_batches_done)

    @property
    def finished(self) -> bool:
        """Exhausted, or its last batch handed out (a state taken now belongs to the next epoch)."""
        return self.complete or self.at_last_batch()


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
        p, loader = self.pass_, self.loader
        if complete:
            p.complete = True
        if complete or p.finished:  # also after a break on the last batch: a skip covers one pass only
            loader._len_skip = 0
        p.running = False
        loader.gradient_state.exit_dataloader(loader)

    def __del__(self) -> None:
        self.close()


__all__ = ["EPOCH_START", "Pass", "PassEnd", "Position"]
