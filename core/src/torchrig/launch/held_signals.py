"""SIGUSR1 that reaches ``torchrig launch`` before its workers exist is held, then passed on;
SIGTERM/SIGHUP then are held too, and no worker is started.

Why: SIGUSR1's default action ends a process. A scheduler's preemption warning (Slurm
``--signal=USR1@T``) that arrived while the launcher was still importing, resolving its
configuration or rendezvousing ended it with exit -10, no worker started, no checkpoint and no
``run_status.json``. So the entry points (``torchrig``, ``python -m torchrig.launch``) call
:func:`hold` in their first lines, before any heavy import; :mod:`torchrig.launch.elastic` takes
what was held (:func:`take`) and passes it on to the ranks as soon as they exist; a held stop
signal (SIGTERM, SIGHUP: the job is being ended) means no worker starts and the launch exits
128 + N with a ``run_status.json`` that says so (it died of the signal, and wrote nothing). A command that
launches nothing (:func:`release`) gets the default action back, and what was held is raised
again, so for it nothing changed.

Imports nothing but :mod:`os`, :mod:`signal` and :mod:`threading`: it runs before everything else.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

#: The signal held and passed on: a warning the ranks answer (a preemption checkpoint), never a stop.
HELD_SIGNAL = signal.SIGUSR1
#: Stop requests held too: the launch then starts no worker and exits 128 + N with ``run_status.json``
#: (SIGINT already is a ``KeyboardInterrupt``, handled by the launcher's entry point).
HELD_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)

_held: list[int] = []
_previous: dict[int, Any] = {}
_holding = False


def _remember(signum: int, frame: Any) -> None:
    _held.append(signum)


def started_as_torchrig(argv0: str) -> bool:
    """Whether this process is the ``torchrig`` command (its console script, ``python -m torchrig``),
    not a program that imports the CLI (whose signals are its own)."""
    return os.path.basename(argv0) == "torchrig" or argv0.endswith(os.path.join("torchrig", "__main__.py"))


def hold() -> None:
    """From now on, remember :data:`HELD_SIGNAL` instead of dying of it (main thread only; idempotent)."""
    global _previous, _holding
    if _holding or threading.current_thread() is not threading.main_thread():
        return
    _previous = {signum: signal.signal(signum, _remember) for signum in (HELD_SIGNAL, *HELD_STOP_SIGNALS)}
    _holding = True


def stop_requested() -> int | None:
    """The first stop signal held (not taken), or None."""
    return next((signum for signum in _held if signum != HELD_SIGNAL), None)


def take() -> list[int]:
    """The signals held so far (each once); the caller now owns passing them on."""
    taken = list(_held)
    del _held[:]
    return taken


def release() -> None:
    """Give the signal its handler from before :func:`hold` back and raise what was held again."""
    global _holding
    if not _holding:
        return
    for signum, previous in _previous.items():
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
    _holding = False
    for signum in take():
        signal.raise_signal(signum)


__all__ = ["HELD_SIGNAL", "HELD_STOP_SIGNALS", "hold", "release", "started_as_torchrig", "stop_requested", "take"]
