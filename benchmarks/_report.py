"""One result row per benchmark, for ``run_all.py``'s table.

Each benchmark prints its own detailed report and, at the end, calls :func:`emit` with a
summary; when ``BENCH_RESULTS_FILE`` names a file (``run_all.py`` sets it), the row is
appended there as one JSON line. Run alone, a benchmark just prints.
"""

from __future__ import annotations

import json
import os
from typing import Any

RESULTS_ENV = "BENCH_RESULTS_FILE"  # not TORCHRIG_*: those are configuration, checked strictly


def emit(bench_id: str, what: str, value: str, goal: str, ok: bool | None, peers: dict[str, str] | None = None) -> None:
    """``ok``: True/False against the goal, None when the row was skipped (no GPU, no peer)."""
    path = os.environ.get(RESULTS_ENV)
    if not path:
        return
    row: dict[str, Any] = {"id": bench_id, "what": what, "value": value, "goal": goal, "ok": ok, "peers": peers or {}}
    with open(path, "a") as handle:
        handle.write(json.dumps(row) + "\n")
