"""The worker processes a :class:`~torchrig.testing.pool.WorkerPool` holds, from the parent's side:
one generation of them (spawned with the pool's environment, killed with their whole process
group, reaped), the state a pool's finalizer closes, stack dumps of stuck ranks, and the exit
hook that leaves no worker behind.

Separate from :mod:`torchrig.testing.pool`, which decides *when* to start, restart and give up
on ranks; this module is *how* processes are owned and swept (the "no orphans" guarantee).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.connection
import multiprocessing.util  # noqa: F401  -- imported before our atexit hook is registered, see end
import os
import shutil
import signal
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from torchrig.testing.pool_worker import send_message

__all__ = ["CLOSE_TIMEOUT", "LIVE_STATES", "REAP_TIMEOUT", "PoolState", "WorkerProcesses", "dump_stacks", "is_alive",
           "patched_environ"]

REAP_TIMEOUT = 10.0
#: Seconds ``close()`` waits for workers to leave on their own before SIGKILLing them.
CLOSE_TIMEOUT = 15.0
#: Seconds to wait for a faulthandler stack dump after sending SIGUSR1.
STACK_DUMP_TIMEOUT = 2.0
#: Longest text kept per rank in an error message (tracebacks, stack dumps).

_ENVIRON_LOCK = threading.Lock()


@contextlib.contextmanager
def patched_environ(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` while workers are spawned, then restore it.

    The spawned interpreter copies the environment at exec time; variables read before any
    worker code runs (at interpreter start, or at ``import torch`` triggered by importing
    torchrig) only take effect this way.
    """
    with _ENVIRON_LOCK:
        saved = {key: os.environ.get(key) for key in env}
        try:
            os.environ.update(env)
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@attrs.define
class WorkerProcesses:
    """One generation of worker processes (a restart makes a new one)."""

    directory: str
    procs: list[Any] = attrs.field(factory=list)
    conns: list[multiprocessing.connection.Connection] = attrs.field(factory=list)
    stack_paths: list[str] = attrs.field(factory=list)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def kill(self) -> None:
        """SIGKILL every worker's process group, reap the workers, free their resources."""
        for proc in self.procs:
            if proc.pid is None:
                continue
            # The worker leads its own group (setsid): this also kills what its tasks started.
            # Before setsid has run there is no such group (ESRCH) and the direct kill does it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.exitcode is None and _is_our_child(proc.pid):  # never a recycled pid
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, signal.SIGKILL)
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(REAP_TIMEOUT)
        self._release()

    def shutdown(self, timeout: float) -> None:
        """Ask the workers to leave (they destroy the process group), then kill what is left."""
        for conn in self.conns:
            with contextlib.suppress(OSError, ValueError):
                send_message(conn, ("exit",))
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            if proc.pid is not None:
                proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()  # survivors, and anything the workers left in their process groups

    def _release(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()
        for proc in self.procs:
            if proc.exitcode is not None:
                with contextlib.suppress(ValueError, AttributeError):
                    proc.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class PoolState:
    """The part of a pool its finalizer needs (it must not reference the pool itself)."""

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        self.workers: WorkerProcesses | None = None
        self.root_dir: str | None = None
        self.closed = False

    def kill_workers(self) -> None:
        workers, self.workers = self.workers, None
        if workers is not None and os.getpid() == self.owner_pid:
            workers.kill()

    def shutdown_workers(self, timeout: float = CLOSE_TIMEOUT) -> None:
        workers, self.workers = self.workers, None
        if workers is not None and os.getpid() == self.owner_pid:
            workers.shutdown(timeout)

    def close(self) -> None:
        self.closed = True
        if os.getpid() != self.owner_pid:  # a forked copy must not touch its parent's workers
            return
        try:
            self.shutdown_workers()
        finally:
            root, self.root_dir = self.root_dir, None
            if root is not None:
                shutil.rmtree(root, ignore_errors=True)


def _is_our_child(pid: int) -> bool:
    """Whether ``pid`` is (still) a child of this process, so that signalling it is safe."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ppid = int(f.read().rpartition(b")")[2].split()[1])
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")  # no /proc: trust multiprocessing's bookkeeping
    except (OSError, IndexError, ValueError):
        return False
    return ppid == os.getpid()


def is_alive(proc: Any) -> bool:
    """Whether a worker is running; a zombie counts as dead even before ``waitpid`` reports it
    (some kernels / sandboxes such as gVisor show the zombie in ``/proc`` first)."""
    if proc.exitcode is not None:
        return False
    try:
        with open(f"/proc/{proc.pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except FileNotFoundError:
        # Reaped behind multiprocessing's back (e.g. by leftover_processes), or no /proc at all.
        return not os.path.isdir("/proc/self")
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X", b"x")


def dump_stacks(workers: WorkerProcesses, ranks: Sequence[int]) -> dict[int, str]:
    """Ask the given (live) ranks for their Python stacks via faulthandler/SIGUSR1."""
    sizes: dict[int, int] = {}
    for rank in ranks:
        path = workers.stack_paths[rank]
        try:
            sizes[rank] = os.path.getsize(path)
            os.kill(workers.procs[rank].pid, signal.SIGUSR1)
        except OSError:
            continue
    deadline = time.monotonic() + STACK_DUMP_TIMEOUT
    waiting = set(sizes)
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        for rank in list(waiting):
            with contextlib.suppress(OSError):
                if os.path.getsize(workers.stack_paths[rank]) > sizes[rank]:
                    waiting.discard(rank)
    if len(waiting) < len(sizes):
        time.sleep(0.1)  # let the dumps that started finish
    stacks: dict[int, str] = {}
    for rank, size in sizes.items():
        try:
            with open(workers.stack_paths[rank], errors="replace") as f:
                f.seek(size)
                stacks[rank] = f.read()
        except OSError:
            continue
    return stacks


# --------------------------------------------------------------------------------------------
# interpreter exit

#: State of every pool not yet garbage collected (a finalizer keeps it alive until it ran).
LIVE_STATES: weakref.WeakSet[PoolState] = weakref.WeakSet()


def _close_live_pools() -> None:
    """Close every pool still open at exit.

    Registered after ``multiprocessing.util`` is imported, so it runs *before* multiprocessing's
    own exit hook, which would otherwise wait forever for our workers: they are not daemonic,
    because a daemonic process may not start children and tasks may (DataLoader workers).
    """
    for state in list(LIVE_STATES):
        with contextlib.suppress(Exception):
            state.close()


atexit.register(_close_live_pools)
