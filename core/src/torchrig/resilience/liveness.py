"""Whether a process is alive, asked by pid — the one question the launcher's worker wrapper and
the checkpoint temporaries' ownership check share. Standard library only, so importing it costs
nothing on the worker's start path."""

from __future__ import annotations

import os


def process_is_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError):  # not a pid at all (a damaged record)
        return False
    return True


__all__ = ["process_is_alive"]
