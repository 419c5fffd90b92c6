"""Find and kill processes a test left behind.

Why: multi-process tests (launchers, elastic agents, fault injection) start processes that can
outlive the test when something goes wrong, and a leftover rank holding a port, a file lock or
CPU makes *later* tests fail in confusing ways. Tests therefore track what they start and
assert that nothing survives; a survivor is killed (with everything in its process group and
session) and named in the failure, instead of silently leaking.

Processes are identified by pid *and* by process group / session: a process started in a new
session (:func:`spawn_in_new_session`, the pool's workers) leads a group and a session whose
id is its pid, so grandchildren it starts are still found after it exits. Everything is read
from ``/proc`` (Linux only).

Zombies (exited, not yet reaped) count as gone. A zombie that is a child of the test process is
reaped on the way (``waitpid(WNOHANG)``), so tests do not accumulate zombies; note that this
takes the exit status away from a ``subprocess.Popen`` / ``multiprocessing.Process`` object that
had not collected it yet (``Popen`` then reports return code 0) -- keep the handle and call
``poll()`` / ``join()`` first where the status matters, or pass ``reap=False``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

__all__ = ["ProcessGuard", "leftover_processes", "spawn_in_new_session"]


@attrs.frozen
class _Proc:
    pid: int
    ppid: int
    pgrp: int
    sid: int
    state: str
    comm: str

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X", "x")


def _read_stat(pid: int) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:  # gone, or not ours to read
        return None
    # "pid (comm) state ppid pgrp session ...": comm may contain spaces and parentheses.
    left, _, right = raw.rpartition(")")
    try:
        comm = left.split("(", 1)[1]
        fields = right.split()
        return _Proc(pid=pid, ppid=int(fields[1]), pgrp=int(fields[2]), sid=int(fields[3]), state=fields[0], comm=comm)
    except (IndexError, ValueError):
        return None


def _process_table() -> list[_Proc]:
    procs = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            proc = _read_stat(int(entry))
            if proc is not None:
                procs.append(proc)
    return procs


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        raw = b""
    text = raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")
    if text:
        return text
    proc = _read_stat(pid)
    return f"[{proc.comm}]" if proc else "[gone]"


def _normalise(ids: Iterable[Any]) -> list[int]:
    out: list[int] = []
    for item in ids:
        pid = int(getattr(item, "pid", item))
        if pid <= 0:
            raise ValueError(f"not a pid or process group id: {pid}")
        if pid not in out:
            out.append(pid)
    return out


def _members(ids: Sequence[int], *, reap: bool, keep: Iterable[int] = ()) -> dict[int, list[_Proc]]:
    """id -> live processes whose pid, process group or session is that id.

    Zombie children of ours are reaped if ``reap``, except the pids in ``keep`` (their
    ``Popen`` / ``Process`` handle reaps them, keeping the exit status).
    """
    keep = set(keep)
    me = os.getpid()
    wanted = set(ids)
    found: dict[int, list[_Proc]] = {i: [] for i in ids}
    for proc in _process_table():
        keys = {proc.pid, proc.pgrp, proc.sid} & wanted
        if not keys:
            continue
        if not proc.alive:
            if reap and proc.ppid == me and proc.pid not in keep:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(proc.pid, os.WNOHANG)
            continue
        for key in keys:
            found[key].append(proc)
    return found


def leftover_processes(pids_or_pgids: Iterable[int], *, reap: bool = True) -> list[int]:
    """Which of the given ids still have a live process.

    An id counts as alive if a running (non-zombie) process has it as its pid, its process
    group id or its session id, so passing the pid of a process started in a new session also
    covers whatever it started. Returns the live ids, in the order given. Zombie children of the
    calling process are reaped when ``reap`` is true (see the module docstring).
    """
    ids = _normalise(pids_or_pgids)
    if not ids:
        return []
    found = _members(ids, reap=reap)
    return [i for i in ids if found[i]]


def _protected() -> tuple[set[int], set[int]]:
    """Pids (us and our ancestors) and process groups that must never be killed."""
    pids = {1, os.getpid()}
    pid = os.getpid()
    for _ in range(64):
        proc = _read_stat(pid)
        if proc is None or proc.ppid <= 1:
            break
        pid = proc.ppid
        pids.add(pid)
    groups = {os.getpgrp(), os.getsid(0)}
    for pid in pids:
        proc = _read_stat(pid)
        if proc is not None:
            groups.add(proc.pgrp)
    return pids, groups


def _kill(procs: Iterable[_Proc]) -> None:
    protected_pids, protected_groups = _protected()
    procs = list(procs)
    for group in sorted({p.pgrp for p in procs} - protected_groups):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for proc in procs:
        if proc.pid not in protected_pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, signal.SIGKILL)


class ProcessGuard:
    """Tracks processes a test starts (pids and their process groups) and asserts none survives.

    ``track`` accepts a pid or an object with a ``pid`` attribute (``subprocess.Popen``,
    ``multiprocessing.Process``); with such a handle the guard reaps the process through it,
    so its exit status stays available. Usable as a context manager: leaving the block runs
    :meth:`assert_none_left` (or just :meth:`kill_all` if the block raised).

    Never kills the test process, its ancestors, or their process groups, even if asked to
    track one of them.
    """

    def __init__(self) -> None:
        self._tracked: dict[int, Any] = {}

    @property
    def tracked(self) -> list[int]:
        return list(self._tracked)

    def track(self, pid: Any) -> None:
        """Watch ``pid`` (and its process group / session, if it leads one)."""
        handle = None if isinstance(pid, int) else pid
        (pid_int,) = _normalise([pid])
        if handle is not None or pid_int not in self._tracked:
            self._tracked[pid_int] = handle

    def _poll_handles(self) -> None:
        for handle in self._tracked.values():
            if handle is None:
                continue
            with contextlib.suppress(Exception):
                if hasattr(handle, "poll"):
                    handle.poll()  # subprocess.Popen
                elif hasattr(handle, "is_alive"):
                    handle.is_alive()  # multiprocessing.Process: reaps it when it has exited

    def leftovers(self) -> list[int]:
        """Tracked ids that still have a live process (reaping tracked children that exited)."""
        if not self._tracked:
            return []
        self._poll_handles()
        found = _members(list(self._tracked), reap=True, keep=self._handle_pids())
        self._poll_handles()  # reap the handles' zombies
        return [i for i, procs in found.items() if procs]

    def _handle_pids(self) -> list[int]:
        return [pid for pid, handle in self._tracked.items() if handle is not None]

    def describe(self) -> list[str]:
        """One line per live process of the tracked ids: pid, group, session, command line."""
        found = _members(list(self._tracked), reap=False)
        lines, seen = [], set()
        for tracked_id, procs in found.items():
            for proc in procs:
                if proc.pid in seen:
                    continue
                seen.add(proc.pid)
                lines.append(
                    f"pid {proc.pid} (pgid {proc.pgrp}, sid {proc.sid}, tracked as {tracked_id}): {_cmdline(proc.pid)}"
                )
        return lines

    def assert_none_left(self, grace: float = 5.0) -> None:
        """Wait up to ``grace`` seconds for the tracked processes to end; kill and fail if not.

        The wait only bounds how long a process may take to exit after the test told it to;
        nothing is measured. Survivors (and their process groups) are SIGKILLed before the
        AssertionError is raised, so one leaking test does not disturb the next.
        """
        deadline = time.monotonic() + grace
        while self.leftovers():
            if time.monotonic() >= deadline:
                lines = self.describe()
                self.kill_all()
                if not lines:  # they ended while we were looking
                    return
                body = "\n".join(f"  {line}" for line in lines)
                raise AssertionError(
                    f"{len(lines)} process(es) outlived the test ({grace:g} s grace); killed them:\n{body}"
                )
            time.sleep(0.05)

    def kill_all(self, timeout: float = 10.0) -> None:
        """SIGKILL every live tracked process, its process group and session; reap our children."""
        deadline = time.monotonic() + timeout
        while True:
            found = _members(list(self._tracked), reap=True, keep=self._handle_pids())
            procs = {p.pid: p for members in found.values() for p in members}
            if not procs:
                break
            _kill(procs.values())
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
            self._poll_handles()
        for handle in self._tracked.values():
            if handle is None:
                continue
            with contextlib.suppress(Exception):
                if hasattr(handle, "wait"):
                    handle.wait(timeout=max(0.1, deadline - time.monotonic()))
                elif hasattr(handle, "join"):
                    handle.join(max(0.1, deadline - time.monotonic()))
        self.leftovers()  # reap the zombies of tracked children without a handle

    def __enter__(self) -> ProcessGuard:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.assert_none_left()
        else:
            self.kill_all()


def spawn_in_new_session(
    cmd: Sequence[str] | str, *, guard: ProcessGuard | None = None, **popen_kwargs: Any
) -> subprocess.Popen[Any]:
    """``subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)``, tracked by ``guard``.

    A new session makes the child lead its own process group, so it and everything it starts
    can be killed together (``os.killpg(proc.pid, SIGKILL)``) without touching the test process,
    and a Ctrl-C in the terminal does not reach it.
    """
    if popen_kwargs.pop("start_new_session", True) is not True:
        raise ValueError("spawn_in_new_session always starts a new session")
    proc = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
    if guard is not None:
        guard.track(proc)
    return proc
