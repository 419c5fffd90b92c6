"""Which run folders ``./torchrig_logs`` keeps.

Why: every ``torchrig launch`` without ``--log_dir`` writes its status and per-rank logs into
``./torchrig_logs/<YYYYmmdd-HHMMSS>-<id>`` of the working directory; left alone they pile up (17
after a short session). ``launch.log_retention`` (default 20) keeps the newest N: when a launch
ends, the older run folders beyond them are deleted. ``0`` keeps none: a run that succeeded
deletes its own folder too (a failed run's stays, since its summary points there, until the
next launch).

What is never deleted: a folder given with ``--log_dir`` (the operator's choice, and so are its
neighbours), anything under the root not named like a run id, and a run folder without a
``run_status.json`` younger than :data:`UNFINISHED_GRACE_S` (a launch still running from the
same directory; one killed with ``kill -9`` writes none and goes after that). Torch-free.
"""

from __future__ import annotations

import os
import re
import shutil
import time

from torchrig.launch.status import RUN_STATUS_FILE

#: The launcher's default log root, relative to the working directory.
DEFAULT_LOG_ROOT = "torchrig_logs"
#: The run folders' names: ``<YYYYmmdd-HHMMSS>-<6 hex digits>`` (so they sort by start time).
RUN_FOLDER_NAME = re.compile(r"^\d{8}-\d{6}-[0-9a-f]{6}$")
#: A run folder with no ``run_status.json`` is left alone this long (its launch may be running).
UNFINISHED_GRACE_S = 24 * 3600.0


def prune_run_folders(root: str, keep: int, *, current: str | None = None, current_succeeded: bool = False) -> list[str]:
    """Delete the run folders under ``root`` beyond the newest ``keep``; the paths deleted.

    ``current``: this launch's folder, counted among the newest; deleted only when ``keep`` is 0
    and ``current_succeeded``."""
    try:
        names = sorted(name for name in os.listdir(root) if RUN_FOLDER_NAME.match(name))
    except OSError:
        return []
    current_name = os.path.basename(os.path.normpath(current)) if current else None
    removed = []
    for name in names[: max(0, len(names) - keep)]:
        path = os.path.join(root, name)
        if name == current_name and not current_succeeded:
            continue
        if name != current_name and not _finished(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed


def _finished(path: str) -> bool:
    if os.path.exists(os.path.join(path, RUN_STATUS_FILE)):
        return True
    try:
        return time.time() - os.path.getmtime(path) > UNFINISHED_GRACE_S
    except OSError:
        return False


def where_logs_go(log_dir: str, retention: int | None) -> str:
    """How the launch's start line says where its logs are and how long they stay.
    ``retention`` None: an explicit ``--log_dir``, never pruned."""
    if retention is None:
        return f"status and logs in {log_dir}"
    if retention == 0:
        return f"status and logs in {log_dir} (deleted if the run succeeds: launch.log_retention 0)"
    return f"status and logs in {log_dir} (the last {retention} runs' folders are kept: launch.log_retention)"


__all__ = ["DEFAULT_LOG_ROOT", "RUN_FOLDER_NAME", "UNFINISHED_GRACE_S", "prune_run_folders", "where_logs_go"]
