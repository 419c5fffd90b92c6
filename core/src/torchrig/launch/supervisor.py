"""A rank's process tree dies with the rank, and with the launcher, even on ``kill -9``.

Why: ``prctl(PR_SET_PDEATHSIG)`` makes a worker die with its launcher, but the processes the
worker started (a ``subprocess``, ``multiprocessing`` children, DataLoader workers, a daemon that
called ``setsid``) are not its process group's hostages: when the worker is SIGKILLed they are
re-parented to init and live on. torchrun has the same hole; systemd and container runtimes
close it with a *subreaper* — a process that inherits every orphan of its subtree.

So the wrapper forks before running anything (:func:`supervise`):

* the **supervisor** (the parent, the pid the launcher sees) marks itself
  ``PR_SET_CHILD_SUBREAPER``: every descendant of the rank whose parent dies is re-parented to
  it, whatever session or process group it moved to, so the whole tree stays findable;
* the **rank** (the child) runs the script as before, dying with the supervisor
  (``PR_SET_PDEATHSIG``, set by the wrapper);
* when the rank exits, the supervisor ends what it left behind (SIGTERM, then SIGKILL after
  :data:`LEFTOVER_GRACE_S`) and exits with the rank's status (re-raising its signal), so the
  launcher sees exactly what the rank did;
* when the launcher dies (a ``PR_SET_PDEATHSIG`` signal, or a changed parent pid), the
  supervisor SIGKILLs the whole tree at once — the same fate ``PR_SET_PDEATHSIG`` gives the rank;
* SIGUSR1 (a preemption warning) sent to the supervisor is passed on to the rank;
* a stop signal (the launcher signals the supervisor's process group, which the rank shares)
  is the rank's to handle; if the tree is still there ``kill_grace`` seconds later, the
  supervisor SIGKILLs it, before the launcher's own SIGKILL would kill the supervisor first and
  orphan the rest. Where the launcher signals the supervisor's pid alone (``notebook_launcher``:
  torch's forked workers share the notebook's process group), ``forward_stop_signals`` passes
  the signal on to the rank.

Linux only (``prctl``); elsewhere :func:`supervise` returns at once and nothing changes.
Imports nothing heavy: it runs before the user's script.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from typing import Any

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: The signal the kernel sends the supervisor when the launcher dies (it is waited for, not handled).
PARENT_DIED = signal.SIGUSR2
#: Passed on to the rank by the supervisor: a preemption warning, the rank's to answer.
RELAYED = signal.SIGUSR1
#: Seconds the processes a finished rank left behind get between SIGTERM and SIGKILL.
LEFTOVER_GRACE_S = 0.5
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_POLL_S = 0.25


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


_loaded_libc: Any = None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when its parent dies. False where unsupported.
    Also a ``preexec_fn`` (of ``--no_python`` children): libc is loaded once, beforehand."""
    global _loaded_libc
    if not sys.platform.startswith("linux"):
        return False
    try:
        if _loaded_libc is None:
            _loaded_libc = _libc()
        return _loaded_libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def supervise(kill_grace: float, *, forward_stop_signals: bool = False) -> None:
    """Fork the rank off this process and supervise it; returns only in the rank (the child).

    ``forward_stop_signals``: pass SIGTERM/SIGINT/SIGHUP on to the rank (when the launcher
    signals this pid alone, not a process group the rank shares).
    Returns at once, supervising nothing, where Linux's ``prctl`` is not available.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = _libc()
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    launcher = os.getppid()
    # SIGUSR1 is the rank's (a preemption warning the launcher forwards): waited for here, where its
    # default action would end the supervisor and, through the parent-death signal, the rank, and
    # passed on to the rank — also one that reached this process before the fork (a pending signal
    # is not inherited by a forked child).
    watched = {signal.SIGCHLD, PARENT_DIED, RELAYED, *_STOP_SIGNALS}
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DIED), 0, 0, 0)
    pid = os.fork()
    if pid == 0:  # the rank: as if nothing happened (the subreaper mark is not inherited)
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        return
    _supervise(pid, launcher, watched, kill_grace, forward_stop_signals)


def _supervise(rank: int, launcher: int, watched: set[int], kill_grace: float, forward_stop_signals: bool) -> None:
    """The supervisor's whole life; ends the process."""
    me = os.getpid()
    exited: dict[int, int] = {}  # wait status of every child reaped, the rank's among them
    kill_at: float | None = None
    while True:
        info = signal.sigtimedwait(watched, _POLL_S)
        _reap_all(exited)
        if rank in exited:
            end_tree(me, grace=LEFTOVER_GRACE_S, exited=exited)
            _exit_like(exited[rank])
        if os.getppid() != launcher or (info is not None and info.si_signo == PARENT_DIED):
            end_tree(me, grace=0.0, exited=exited)
            os._exit(128 + signal.SIGKILL)
        if info is not None and info.si_signo == RELAYED:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, RELAYED)
        if info is not None and info.si_signo in _STOP_SIGNALS:
            if forward_stop_signals:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank, info.si_signo)
            if kill_at is None:
                kill_at = time.monotonic() + kill_grace
        if kill_at is not None and time.monotonic() >= kill_at:
            end_tree(me, grace=0.0, exited=exited)  # the rank included: its status is reaped next round
            kill_at = float("inf")


def _exit_like(status: int) -> None:
    """Leave as the rank left: its exit code, or killed by its signal (for the launcher's report)."""
    sys.stdout.flush()
    if os.WIFEXITED(status):
        os._exit(os.WEXITSTATUS(status))
    signum = os.WTERMSIG(status)
    with contextlib.suppress(OSError, ValueError):  # SIGKILL/SIGSTOP have no handler to reset
        signal.signal(signum, signal.SIG_DFL)
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default is not to end the process


def direct_children(pid: int) -> list[int]:
    """Live children of ``pid`` (from ``/proc``): a supervisor's is its rank."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                fields = handle.read().decode(errors="replace").rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 1 and fields[0] not in ("Z", "X", "x") and int(fields[1]) == pid:
            found.append(int(entry))
    return found


def descendants(root: int) -> list[int]:
    """Live processes below ``root`` (from ``/proc``), parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                raw = handle.read().decode(errors="replace")
        except OSError:
            continue
        fields = raw.rpartition(")")[2].split()
        if len(fields) > 1 and fields[0] not in ("Z", "X", "x"):
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def end_tree(root: int, *, grace: float, exited: dict[int, int] | None = None) -> None:
    """End every descendant of ``root``: SIGTERM and up to ``grace`` seconds, then SIGKILL until
    none is left. Orphans re-parent to ``root`` (a subreaper), so a process forked meanwhile is
    found on the next round; ``root``'s exited children are reaped on the way (their wait
    statuses go to ``exited``)."""
    exited = {} if exited is None else exited
    if grace > 0:
        _signal_all(descendants(root), signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and descendants(root):
            _reap_all(exited)
            time.sleep(0.02)
    for _ in range(1000):
        left = descendants(root)
        _reap_all(exited)
        if not left:
            return
        _signal_all(left, signal.SIGKILL)
        time.sleep(0.005)


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _reap_all(exited: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exited[pid] = status


__all__ = ["LEFTOVER_GRACE_S", "PARENT_DIED", "RELAYED", "descendants", "direct_children", "end_tree", "set_parent_death_signal",
           "supervise"]
