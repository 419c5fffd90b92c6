"""A rank's status file, from inside the rank: what the Accelerator, its checkpoint manager and
its trackers record (last checkpoint, preemption, tracker drops) for the launcher to merge, and
what a rank is waiting on (``waiting``: a plugin that sees its rank blocked outside any collective,
on a file lock say, records what and how to clear it; the launcher's summary names it when the run
is stopped).

Below everything that records (checkpoint, tracking, accelerator) and below :mod:`torchrig.launch`,
which owns the file's lifecycle: the worker wrapper creates the file and sets it current
(:func:`_set_current`); the launcher reads and merges the files (:mod:`torchrig.launch.status`).
Every write is atomic (temporary file, fsync, rename). Torch-free.
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
#: A rank that stopped after a preemption checkpoint (:mod:`torchrig.resilience.preemption`): neither a failure nor the end.
PREEMPTED = "preempted"


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
    "FAILED", "FINISHED", "INTERRUPTED", "PREEMPTED", "RUNNING", "TERMINATED", "RankStatus", "current", "record",
    "write_json_atomic",
]
