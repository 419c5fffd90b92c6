"""Asynchronous saves in flight, and what happens to them when the script ends first.

A script may end right after ``save_state(async_save=True)`` without ``end_training()``. The
save is then finished at interpreter exit, on every rank (its commit is collective, so every
rank must take part), before Python's own exit handlers run — the process group is still up
then. If it fails, the error is printed naming the checkpoint and the process exits with
status 1: a checkpoint is never lost silently. Under ``torchrig launch`` the worker wrapper calls
:func:`finish_all` as soon as the script returns, so a rank whose last save failed is recorded
``failed`` with that error, never ``finished``.

This module imports nothing heavy: the launch worker looks it up in ``sys.modules``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Callable

#: Saves started and not yet reported to the training thread (by ``wait``) or at exit.
_UNREPORTED: list[PendingSave] = []
_LOCK = threading.Lock()
_exit_hook_installed = False


class PendingSave:
    """A save whose files and commit are being finished by a background thread."""

    def __init__(self, target: str, work: Callable[[], str], describe: Callable[[BaseException], str]) -> None:
        self.target = target
        self.error: BaseException | None = None
        self._describe = describe
        # Not a daemon: nothing may cut a commit short; the exit hook below waits for it anyway.
        self._thread = threading.Thread(target=self._run, args=(work,), name="torchrig-checkpoint", daemon=False)
        with _LOCK:
            _UNREPORTED.append(self)
        _install_exit_hook()
        self._thread.start()

    def _run(self, work: Callable[[], str]) -> None:
        try:
            work()
        except BaseException as exc:
            self.error = exc

    def join(self) -> None:
        """Wait for the save; from now on its outcome is the caller's to report."""
        self._thread.join()
        with _LOCK:
            if self in _UNREPORTED:
                _UNREPORTED.remove(self)

    def failure(self) -> str | None:
        if self.error is None:
            return None
        return f"the asynchronous save to {self.target} failed: {self._describe(self.error)}"


def finish_all() -> list[str]:
    """Finish every save nobody waited for; returns the failures (each naming its checkpoint)."""
    failures = []
    while True:
        with _LOCK:
            if not _UNREPORTED:
                return failures
            pending = _UNREPORTED[0]
        pending.join()
        message = pending.failure()
        if message is not None:
            failures.append(message)


def _at_exit() -> None:
    """Interpreter exit: finish the last saves; a failure is printed and the exit status is 1."""
    failures = finish_all()
    if not failures:
        return
    for message in failures:
        print(f"torchrig: checkpoint lost: {message}", file=sys.stderr, flush=True)
    # A failure at exit cannot change the status through sys.exit (ignored there): run the
    # normal exit handlers now (trackers, process groups), then leave with status 1.
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) has none of the parent's saves to finish."""
    global _LOCK
    _LOCK = threading.Lock()
    _UNREPORTED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _install_exit_hook() -> None:
    """Runs in ``threading._shutdown``, before non-daemon threads are joined and before atexit
    handlers (which may tear down the process group the commit needs)."""
    global _exit_hook_installed
    with _LOCK:
        if _exit_hook_installed:
            return
        _exit_hook_installed = True
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(_at_exit)
    except RuntimeError:  # an old or future Python: a plain atexit handler still reports the failure
        atexit.register(_at_exit)


__all__ = ["PendingSave", "finish_all"]
