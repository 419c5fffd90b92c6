"""Dispatch: rank 0 reads every rank's batches and broadcasts each global batch, so a stream
that cannot be split (or is expensive to read) is read once. Used by the prepared loader's
look-ahead pass."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from torchrig.data.plan import BatchMeta

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.distributed.collectives import Collectives


def _rounds(read: Callable[[], Iterator[tuple[Any, BatchMeta]]], world: int) -> Iterator[tuple[list[Any], BatchMeta]]:
    """Every rank's part of each global batch (None where a rank gets none) and its meta."""
    parts: list[Any] = [None] * world
    count = 0
    for batch, meta in read():
        parts[meta.slot] = batch
        count += 1
        if count == meta.nparts:
            yield parts, meta
            parts, count = [None] * world, 0


def dispatched(collectives: Collectives | None, rank: int, world: int, is_source: bool,
               read: Callable[[], Iterator[tuple[Any, BatchMeta]]]) -> Iterator[tuple[Any, BatchMeta]]:
    """This rank's batches: the source rank reads every rank's (``read()``: all slots, called
    where a failure is reported to the others) and broadcasts each global batch; the others
    receive.

    One message per global batch, ``("batch", parts, meta, final)``; the source reads one global
    batch ahead to set ``final``, so every rank receives exactly the same messages and stops
    after the final one (no trailing collective to forget); ``("end",)`` for an empty pass;
    ``("error", text)`` when reading failed on the source, so the others raise instead of
    hanging. A meta's ``last`` is left to the loader's look-ahead (the round's meta is one
    rank's, and its last batch may not be this rank's).
    """
    assert collectives is not None

    def send(message: tuple[Any, ...]) -> None:
        collectives.broadcast_object_list([message], src=0)

    if not is_source:
        while True:
            message = collectives.broadcast_object_list([None], src=0)[0]
            if message[0] == "end":
                return
            if message[0] == "error":
                raise RuntimeError(f"the data-loading process (rank 0) failed; its error:\n{message[1]}")
            _, parts, meta, final = message
            mine = parts[rank]
            if mine is None:
                return
            yield mine, meta._replace(slot=rank, last=False)
            if final:
                return
    rounds = _rounds(read, world)
    try:
        current = next(rounds, None)
    except Exception as exc:
        send(("error", f"{type(exc).__name__}: {exc}"))
        raise
    if current is None:
        send(("end",))
        return
    while True:
        try:
            following = next(rounds, None)
        except Exception as exc:
            send(("error", f"{type(exc).__name__}: {exc}"))
            raise
        parts, meta = current
        send(("batch", parts, meta, following is None))
        if parts[rank] is None:
            return
        yield parts[rank], meta._replace(slot=rank, last=False)
        if following is None:
            return
        current = following


__all__ = ["dispatched"]
