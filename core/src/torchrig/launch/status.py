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
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: ``state`` values of a rank status file.
RUNNING, FINISHED, FAILED, TERMINATED, INTERRUPTED = "running", "finished", "failed", "terminated", "interrupted"
#: A rank that stopped after a preemption checkpoint (:mod:`torchrig.preemption`): neither a failure nor the end.
PREEMPTED = "preempted"
RUN_STATUS_FILE = "run_status.json"
#: Lines of a traceback (or of a command's stderr) kept in status files and the summary.
TAIL_LINES = 40


def rank_status_path(log_dir: str | os.PathLike[str], rank: int | str) -> Path:
    return Path(log_dir) / f"rank-{rank}.status.json"


def write_json_atomic(path: str | os.PathLike[str], data: Mapping[str, Any]) -> None:
    """Write ``data`` as JSON so that readers see the old file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(data, handle, indent=2, default=str)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


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


class RankStatus:
    """The status file of one rank, owned by the process that runs that rank.

    ``update`` merges fields and rewrites the file atomically. Also usable by code running
    inside the worker (see :func:`record`), e.g. to add warnings the launcher should show.
    """

    def __init__(self, path: str | os.PathLike[str], **fields: Any) -> None:
        self.path = Path(path)
        now = time.time()
        self.data: dict[str, Any] = {
            "state": RUNNING, "pid": os.getpid(), "started_at": now, "updated_at": now, "ended_at": None,
            "exit_code": None, "error": None, "traceback": None, "warnings": [],
        }
        self.data.update(fields)
        write_json_atomic(self.path, self.data)

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.data["updated_at"] = time.time()
        write_json_atomic(self.path, self.data)

    def warn(self, message: str) -> None:
        self.update(warnings=[*self.data.get("warnings", []), message])


#: The status of the rank this process runs, when it runs under ``torchrig launch``.
_current: RankStatus | None = None


def current() -> RankStatus | None:
    """This worker's status file when started by ``torchrig launch``; None otherwise."""
    return _current


def record(**fields: Any) -> bool:
    """Merge ``fields`` into this worker's status file (no-op without the launcher). Returns
    whether it was written. For the Accelerator and plugins: last checkpoint, tracker drops."""
    status = _current
    if status is None:
        return False
    warnings = fields.pop("warnings", None)
    if warnings:
        fields["warnings"] = [*status.data.get("warnings", []), *warnings]
    status.update(**fields)
    return True


def _set_current(status: RankStatus | None) -> None:
    global _current
    _current = status


__all__ = [
    "FAILED", "FINISHED", "INTERRUPTED", "RUNNING", "RUN_STATUS_FILE", "TERMINATED", "RankStatus", "current",
    "rank_status_path", "read_json", "read_tail", "record", "tail", "write_json_atomic",
]
