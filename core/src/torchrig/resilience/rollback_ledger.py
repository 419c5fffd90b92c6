"""The training guard's skip ledger: which batches a rollback skips, kept beside the checkpoints.

A rollback restarts the run from its last committed checkpoint; the restarted ranks must not train
on the batches that made the bad step again. The ledger is one JSON file in the checkpoints
directory (``<root>/training_guard_ledger.json``), written atomically by rank 0 before the ranks
exit, read by every rank when ``load_state`` loads a checkpoint of that directory::

    {"version": 1, "rollbacks": 1,
     "entries": [{"step": 2, "checkpoint": "checkpoint_1", "reason": "...",
                  "batches": [{"dataloader": 0, "epoch": 0, "batch": 5}]}]}

A batch is named by its position in the data stream: the prepared dataloader (in prepare order),
the epoch and this-rank batch number within the epoch (every data-parallel rank's batch of that
number is skipped alike). ``rollbacks`` counts the rollbacks made for this directory, the bound
``training_guard.max_rollbacks`` is checked against. No torch: plain files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from torchrig.resilience.run_status import write_json_atomic

#: The ledger's file name inside the checkpoints directory.
LEDGER_FILE = "training_guard_ledger.json"
LEDGER_VERSION = 1


@attrs.frozen
class SkippedBatch:
    """One batch of a prepared dataloader, by position: the same one on every attempt."""

    dataloader: int
    epoch: int
    batch: int

    def describe(self) -> str:
        return f"dataloader {self.dataloader} epoch {self.epoch} batch {self.batch}"


def describe_batches(batches: Iterable[SkippedBatch]) -> str:
    """``dataloader 0 epoch 0 batch 5, ...`` (or ``no batch of a prepared dataloader``)."""
    text = ", ".join(batch.describe() for batch in batches)
    return text or "no batch of a prepared dataloader"


@attrs.frozen
class SkipLedger:
    """The rollbacks made for one checkpoints directory and the batches they skip."""

    rollbacks: int = 0
    entries: tuple[Mapping[str, Any], ...] = ()

    def skipped(self, dataloader: int) -> frozenset[tuple[int, int]]:
        """``(epoch, batch)`` of every batch of prepared dataloader ``dataloader`` to skip."""
        return frozenset((int(b["epoch"]), int(b["batch"])) for entry in self.entries for b in entry["batches"]
                         if int(b["dataloader"]) == dataloader)

    def with_rollback(self, *, step: int, checkpoint: str, reason: str,
                      batches: Iterable[SkippedBatch]) -> SkipLedger:
        entry = {"step": step, "checkpoint": checkpoint, "reason": reason,
                 "batches": [attrs.asdict(batch) for batch in batches]}
        return SkipLedger(rollbacks=self.rollbacks + 1, entries=(*self.entries, entry))


def ledger_path(checkpoints_root: str | os.PathLike[str]) -> str:
    return os.path.join(os.fspath(checkpoints_root), LEDGER_FILE)


def read_ledger(checkpoints_root: str | os.PathLike[str]) -> SkipLedger:
    """The directory's ledger; an empty one when there is none. A damaged one is an error naming the file."""
    path = ledger_path(checkpoints_root)
    try:
        with open(path) as handle:
            data = json.load(handle)
        return SkipLedger(rollbacks=int(data["rollbacks"]), entries=tuple(data["entries"]))
    except FileNotFoundError:
        return SkipLedger()
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"training_guard: the skip ledger {path} cannot be read ({exc}); delete it to forget the "
                         "recorded rollbacks and skipped batches") from exc


def write_ledger(checkpoints_root: str | os.PathLike[str], ledger: SkipLedger) -> str:
    """Write atomically (readers see the old ledger or the new one); returns the path."""
    path = ledger_path(checkpoints_root)
    write_json_atomic(path, {"version": LEDGER_VERSION, "rollbacks": ledger.rollbacks,
                             "entries": list(ledger.entries)})
    return path


__all__ = ["LEDGER_FILE", "SkipLedger", "SkippedBatch", "describe_batches", "ledger_path", "read_ledger",
           "write_ledger"]
