"""Status files: how a worker tells the launcher what happened to it, even when it crashed.

Each worker's wrapper (:mod:`torchrig.launch.worker`) keeps ``<log_dir>/rank-N.status.json``
up to date; the launcher merges them into ``<log_dir>/run_status.json``. Why files: they
survive the process (a rank killed by a signal still leaves its last state), they need no
connection to the launcher (no port, nothing to hang on), and ``cat`` reads them. Every write
is atomic (temporary file, fsync, rename) so a reader never sees half a file, whoever dies when.

Torch-free: the wrapper imports this before the user's script.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# The state values, the atomic write and the rank's own status file live below the layers that
# record into it (torchrig.resilience.run_status); the launcher reads the files with the same names.
from torchrig.resilience.run_status import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    PREEMPTED,
    RUNNING,
    TERMINATED,
    RankStatus,
    write_json_atomic,
)

RUN_STATUS_FILE = "run_status.json"
#: Lines of a traceback (or of a command's stderr) kept in status files and the summary.
TAIL_LINES = 40


def rank_status_path(log_dir: str | os.PathLike[str], rank: int | str) -> Path:
    return Path(log_dir) / f"rank-{rank}.status.json"


def read_json(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The file's JSON object, or None when it is missing or unreadable (a reader never fails)."""
    try:
        with open(path) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def tail(text: str, lines: int = TAIL_LINES) -> str:
    parts = text.rstrip("\n").splitlines()
    return "\n".join(parts[-lines:])


def read_tail(path: str | os.PathLike[str], lines: int = TAIL_LINES, max_bytes: int = 64 * 1024) -> str:
    """The last ``lines`` lines of a (log) file; empty when it does not exist."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return ""
    return tail(data.decode(errors="replace"), lines)


__all__ = [
    "FAILED", "FINISHED", "INTERRUPTED", "PREEMPTED", "RUNNING", "RUN_STATUS_FILE", "TERMINATED", "RankStatus",
    "rank_status_path", "read_json", "read_tail", "tail", "write_json_atomic",
]
