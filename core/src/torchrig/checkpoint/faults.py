"""Fault injection for the checkpoint commit protocol: a rank SIGKILLs itself at a named phase.

``TORCHRIG_CHECKPOINT_FAULT=<phase>@<rank>`` (e.g. ``before_manifest@0``) kills that rank the
first time it reaches ``phase`` in this process. Tests use it to prove that a kill at any point of
a save loses nothing: the previous checkpoint still loads bit-equal and the partial one is
ignored. The variable is read once per call of :func:`point`, so an unset variable costs a
dictionary lookup; it is never set outside tests.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "TORCHRIG_CHECKPOINT_FAULT"

#: The phases of a save, in order. Rank 0 runs all of them; other ranks pass the rank-0-only ones
#: (from ``before_manifest`` on) while they wait for rank 0's commit.
PHASES = (
    "before_model",            # every rank, before the strategy writes models
    "mid_optimizer",           # every rank that writes an optimizer file, part of it on disk
    "before_manifest",         # all files written and agreed; rank 0 about to write the manifest
    "before_rename",           # manifest written inside the temporary directory
    "before_latest",           # renamed into place (committed), ``latest`` not yet updated
    "before_rotation_delete",  # ``latest`` updated, old checkpoints not yet deleted
)

_fired = False


def parse(value: str) -> tuple[str, int]:
    phase, _, rank = value.partition("@")
    if phase not in PHASES or not rank.strip().isdigit():
        raise ValueError(f"{FAULT_ENV}={value!r}: expected <phase>@<rank> with phase one of {', '.join(PHASES)}")
    return phase, int(rank)


def armed(phase: str, rank: int) -> bool:
    """Whether :func:`point` would kill this rank at ``phase`` (writers then stream the file)."""
    value = os.environ.get(FAULT_ENV)
    return bool(value) and not _fired and parse(value) == (phase, rank)


def point(phase: str, rank: int | None = None) -> None:
    """SIGKILL this process if the fault variable names ``phase`` and this rank."""
    global _fired
    value = os.environ.get(FAULT_ENV)
    if not value or _fired:
        return
    wanted_phase, wanted_rank = parse(value)
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if wanted_phase == phase and wanted_rank == rank:
        _fired = True
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["FAULT_ENV", "PHASES", "armed", "parse", "point"]
