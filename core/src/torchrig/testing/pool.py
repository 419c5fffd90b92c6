"""A pool of long-lived ranks, already joined in a process group, that tests send functions to.

Why: launching a 2-process ``torch.distributed`` job costs seconds (mostly every process
importing torch and rendezvousing), and the test suite needs hundreds of multi-process
scenarios. Like torch's ``MultiProcContinuousTest``, a :class:`WorkerPool` starts ``world_size``
processes once; each joins a gloo process group and then runs the functions the test process
sends it, so a multi-process test costs milliseconds instead of seconds::

    def _sum_ranks(ctx: WorkerContext) -> float:      # module level: sent with plain pickle
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(ctx.rank)])
        dist.all_reduce(t)
        return t.item()

    with WorkerPool(world_size=2) as pool:
        assert pool.run(_sum_ranks, timeout=30) == [1.0, 1.0]

Tasks
    ``pool.run(fn, *args, **kwargs)`` calls ``fn(ctx, *args, **kwargs)`` on every rank, ``ctx``
    being a :class:`WorkerContext`, and returns the results as a list indexed by rank. ``fn``,
    its arguments and its results travel with *plain* :mod:`pickle` (no cloudpickle): ``fn`` must
    be a module-level function of an importable module (a test module is fine: the parent's
    ``sys.path`` and working directory are applied in the workers before each task; with
    pytest's ``--import-mode=importlib`` the module is loaded from its file). Lambdas, closures
    and nested functions cannot be sent; :meth:`WorkerPool.run` says so before sending anything.
    Tasks share one interpreter per rank: a task that changes global state (default dtype,
    seeds, environment variables, new process groups) should undo it.

Failures are reports, not hangs
    * a task raising on some ranks -> :class:`WorkerError` with every failing rank's traceback.
      The other ranks get a short grace (``error_grace``, 5 s) to finish; ranks still running
      then (typically waiting in a collective for the rank that failed) are killed and the pool
      restarts on the next run. If every rank answered, a quick barrier checks that the process
      group is still usable before the pool is reused;
    * ranks not answering within ``timeout`` -> :class:`PoolTimeout` naming them, with their
      Python stacks (dumped with :mod:`faulthandler` on ``SIGUSR1``) so a hang can be debugged;
    * a rank exiting mid-task (a fault-injection test that SIGKILLs itself, a segfault, the
      OOM killer) -> :class:`WorkerDied` naming the rank and its exit code / signal.
    After a kill the pool restarts transparently on the next :meth:`WorkerPool.run`;
    :attr:`WorkerPool.pids` shows the current workers.

No orphans
    Each worker calls ``setsid()`` so that it leads its own process group (which also keeps
    Ctrl-C in the terminal away from it) and everything it starts can be killed with one
    ``killpg``; it asks the kernel (``PR_SET_PDEATHSIG``) to SIGKILL it if the test process
    dies. :meth:`WorkerPool.close` (also run by a ``weakref.finalize`` and at interpreter exit)
    asks the workers to leave, then SIGKILLs the process group of each, so processes a task
    forgot are swept too. Workers' ``tempfile.tempdir`` is a directory inside the pool's own, removed
    with it, so a rank killed mid-task leaves no temporary files behind. Rendezvous uses a ``FileStore`` in a fresh temporary directory, never
    a TCP port, so pools never collide.

Caveats
    * ``PR_SET_PDEATHSIG`` fires when the *thread* that started the workers ends: start the pool
      from the main thread (pytest fixtures do) or from a thread that outlives it.
    * Workers inherit the test process's stdout/stderr (pytest's capture shows their prints);
      ``env`` is applied to the process environment only while the workers are being spawned, so
      variables read at interpreter start or at ``import torch`` (``OMP_NUM_THREADS``) take effect.
    * Linux only (``setsid``, ``prctl``, ``killpg``, ``/proc``).

This module is the parent side (when to start, restart and give up; reporting); how the worker
processes are owned and swept is :mod:`torchrig.testing.pool_processes`, and what runs inside
each rank is :mod:`torchrig.testing.pool_worker`.
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from torchrig.testing.pool_processes import (
    LIVE_STATES,
    REAP_TIMEOUT,
    PoolState,
    WorkerProcesses,
    dump_stacks,
    is_alive,
    patched_environ,
)
from torchrig.testing.pool_worker import WorkerContext, WorkerSpec, worker_main
from torchrig.testing.processes import leftover_processes

__all__ = ["PoolTimeout", "WorkerContext", "WorkerDied", "WorkerError", "WorkerPool", "checked_pool"]

#: Environment every worker gets unless ``env`` overrides it: one OpenMP thread per rank keeps
#: several ranks on a small CI machine from oversubscribing its cores.
DEFAULT_WORKER_ENV: Mapping[str, str] = {"OMP_NUM_THREADS": "1"}

#: Seconds to wait for a SIGKILLed worker to be reaped (it is immediate unless the kernel is stuck).
_MAX_TEXT = 8000


# --------------------------------------------------------------------------------------------
# public types


class WorkerError(AssertionError):
    """A task failed on at least one rank.

    It is an :class:`AssertionError` so that pytest reports it as a test failure, with the
    workers' tracebacks in the message.

    Attributes:
        failures: rank -> formatted traceback of the exception the task raised there (or, for
            :class:`WorkerDied` / :class:`PoolTimeout`, a description of the death / silence).
        stuck: ranks still running when the pool gave up on them (they were killed).
        stacks: rank -> Python stack of each stuck rank, dumped just before it was killed.
        results: rank -> value returned by the ranks that finished the task normally.
        exceptions: rank -> the exception object a rank raised, where it could be pickled.
    """

    def __init__(
        self,
        message: str,
        *,
        failures: Mapping[int, str] | None = None,
        stuck: Sequence[int] = (),
        stacks: Mapping[int, str] | None = None,
        results: Mapping[int, Any] | None = None,
        exceptions: Mapping[int, BaseException] | None = None,
    ) -> None:
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
        self.stuck: tuple[int, ...] = tuple(stuck)
        self.stacks: dict[int, str] = dict(stacks or {})
        self.results: dict[int, Any] = dict(results or {})
        self.exceptions: dict[int, BaseException] = dict(exceptions or {})


class PoolTimeout(WorkerError):
    """Some ranks did not answer within the timeout; ``stuck`` names them (they were killed)."""


class WorkerDied(WorkerError):
    """A worker process exited while it was running a task (or starting).

    ``exitcodes`` maps each dead rank to its exit code: negative means killed by that signal
    (``-9`` = SIGKILL), ``None`` if it could not be determined.
    """

    def __init__(self, message: str, *, exitcodes: Mapping[int, int | None] | None = None, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.exitcodes: dict[int, int | None] = dict(exitcodes or {})


# --------------------------------------------------------------------------------------------
# parent side


def _signal_name(exitcode: int | None) -> str:
    if exitcode is None:
        return "exit code unknown"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"exit code {exitcode}, killed by {name}"
    return f"exit code {exitcode}"


def _clip(text: str) -> str:
    if len(text) <= _MAX_TEXT:
        return text
    return f"[... {len(text) - _MAX_TEXT} characters cut ...]\n" + text[-_MAX_TEXT:]


@attrs.define
class _Outcome:
    replies: dict[int, tuple[Any, ...]]
    died: dict[int, int | None]
    silent: list[int]


class WorkerPool:
    """``world_size`` long-lived processes in a ``backend`` process group, running test tasks.

    Args:
        world_size: number of ranks.
        backend: ``torch.distributed`` backend the workers initialise (``"gloo"`` on CPU).
        env: environment variables for the workers, on top of :data:`DEFAULT_WORKER_ENV`
            (``OMP_NUM_THREADS=1``) and the test process's environment.
        collective_timeout: the process group's timeout (seconds): how long a collective may
            wait before torch itself raises.
        start_timeout: hard limit (seconds) for the workers to import torch and rendezvous.
        error_grace: once one rank has failed or died, how long (seconds) the others get to
            answer before they are considered stuck and killed.

    The workers start on the first :meth:`run` (or :meth:`start`) and after any failure that
    killed them. Use as a context manager, or call :meth:`close`; an unclosed pool is closed
    when garbage collected or at interpreter exit.
    """

    def __init__(
        self,
        world_size: int = 2,
        *,
        backend: str = "gloo",
        env: Mapping[str, str] | None = None,
        collective_timeout: float = 60.0,
        start_timeout: float = 120.0,
        error_grace: float = 5.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = int(world_size)
        self.backend = backend
        self.env: dict[str, str] = {**DEFAULT_WORKER_ENV, **{str(k): str(v) for k, v in (env or {}).items()}}
        self.collective_timeout = float(collective_timeout)
        self.start_timeout = float(start_timeout)
        self.error_grace = float(error_grace)
        self._state = PoolState()
        self._lock = threading.RLock()
        self._task_ids = itertools.count(1)
        self._generations = itertools.count(1)
        self._started_pids: list[int] = []
        # Closes the workers if the pool is garbage collected unclosed; at interpreter exit our
        # own hook (pool_processes._close_live_pools) does it, ahead of multiprocessing's.
        self._finalizer = weakref.finalize(self, self._state.close)
        self._finalizer.atexit = False
        LIVE_STATES.add(self._state)

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        """Pids of the current workers, indexed by rank; empty while none is running."""
        workers = self._state.workers
        return workers.pids() if workers is not None else []

    @property
    def started_pids(self) -> list[int]:
        """Pids of every worker this pool ever started (across restarts), oldest first."""
        return list(self._started_pids)

    @property
    def scratch_dir(self) -> str | None:
        """The directory shared by the ranks (see :attr:`WorkerContext.scratch_dir`), once started."""
        root = self._state.root_dir
        return os.path.join(root, "scratch") if root is not None else None

    @property
    def closed(self) -> bool:
        return self._state.closed

    def start(self) -> None:
        """Start the workers now if they are not running (:meth:`run` does this lazily).

        Raises :class:`WorkerError` / :class:`WorkerDied` / :class:`PoolTimeout` if they cannot
        join the process group within ``start_timeout``; nothing is left running then.
        """
        with self._lock:
            self._check_open()
            workers = self._state.workers
            if workers is not None and all(is_alive(p) for p in workers.procs):
                return
            if workers is not None:  # a worker died between tasks: start afresh
                self._state.kill_workers()
            self._spawn()

    def stop(self) -> None:
        """Stop the workers (gracefully, killing them if they do not leave); the next :meth:`run` starts new ones.

        What a session-wide pool does between test modules: every device mesh a task builds leaves gloo groups
        behind (three polling threads each, and torch's caches hold the meshes, so they cannot be destroyed
        under a later task); after a few modules a rank held ~870 threads burning a third of a core while idle.
        """
        with self._lock:
            self._check_open()
            self._state.shutdown_workers()

    def restart(self) -> None:
        """Stop the workers (gracefully, killing them if they do not leave) and start new ones."""
        with self._lock:
            self._check_open()
            self._state.shutdown_workers()
            self._spawn()

    def close(self) -> None:
        """Stop the workers and delete the pool's temporary files. Idempotent.

        Workers are asked to leave (they destroy their process group); any still alive after
        a timeout, and anything left in their process groups, is SIGKILLed.
        """
        with self._lock:
            self._finalizer()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        status = "closed" if self.closed else ("running" if self._state.workers else "idle")
        return f"<WorkerPool world_size={self.world_size} backend={self.backend!r} {status} pids={self.pids}>"

    def _check_open(self) -> None:
        if self._state.closed:
            raise RuntimeError("this WorkerPool is closed")

    def _spawn(self) -> None:
        state = self._state
        if state.root_dir is None:
            state.root_dir = tempfile.mkdtemp(prefix="torchrig-pool-")
        scratch = os.path.join(state.root_dir, "scratch")
        os.makedirs(scratch, exist_ok=True)
        directory = tempfile.mkdtemp(prefix=f"gen{next(self._generations)}-", dir=state.root_dir)
        workers = WorkerProcesses(directory=directory)
        state.workers = workers  # from here on, kill_workers() cleans up whatever was started
        ctx = multiprocessing.get_context("spawn")
        try:
            with patched_environ(self.env):
                for rank in range(self.world_size):
                    stack_path = os.path.join(directory, f"rank{rank}.stacks")
                    spec = WorkerSpec(
                        rank=rank,
                        world_size=self.world_size,
                        backend=self.backend,
                        store_path=os.path.join(directory, "filestore"),
                        scratch_dir=scratch,
                        stack_path=stack_path,
                        collective_timeout=self.collective_timeout,
                        env=dict(self.env),
                        sys_path=list(sys.path),
                        cwd=os.getcwd(),
                        parent_pid=os.getpid(),
                    )
                    parent_conn, child_conn = ctx.Pipe(duplex=True)
                    proc = ctx.Process(
                        target=worker_main, args=(spec, child_conn), name=f"torchrig-pool-rank{rank}"
                    )
                    workers.conns.append(parent_conn)
                    workers.procs.append(proc)
                    workers.stack_paths.append(stack_path)
                    try:
                        proc.start()
                    finally:
                        child_conn.close()  # so that a dead worker reads as EOF here
                    self._started_pids.append(proc.pid)
            outcome = self._collect(workers, None, self.start_timeout)
            self._raise_for(outcome, workers, what="starting the worker pool", timeout=self.start_timeout, task=False)
        except BaseException:
            state.kill_workers()
            raise

    # -- running tasks ------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; return the results indexed by rank.

        ``timeout`` (seconds) is a hard limit for every rank to answer; it is never used to
        measure anything. Raises :class:`WorkerError` (some rank raised),
        :class:`WorkerDied` (some rank exited) or :class:`PoolTimeout` (some rank did not
        answer); in the last two cases, and when ranks were stuck after an error, the workers
        are killed and the next call starts new ones.
        """
        if timeout is None or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        payload = _pickle_task(fn, args, kwargs)
        module = getattr(fn, "__module__", None)
        module_file = getattr(sys.modules.get(module or ""), "__file__", None)
        with self._lock:
            self.start()
            workers = self._state.workers
            assert workers is not None
            task_id = next(self._task_ids)
            message = pickle.dumps(
                ("run", task_id, list(sys.path), os.getcwd(), module, module_file, payload),
                protocol=pickle.HIGHEST_PROTOCOL,
            )
            del payload
            try:
                for conn in workers.conns:
                    with contextlib.suppress(OSError):  # a dead worker is reported by _collect
                        conn.send_bytes(message)
                del message
                outcome = self._collect(workers, task_id, timeout)
                self._raise_for(outcome, workers, what=f"task {_task_name(fn)}", timeout=timeout, task=True)
            except WorkerError:
                raise
            except BaseException:  # KeyboardInterrupt, pytest-timeout, ...: state unknown
                self._state.kill_workers()
                raise
            if not all(reply[4] for reply in outcome.replies.values()):
                # A task destroyed the default process group: later tasks need a fresh one.
                self._state.shutdown_workers()
            return [outcome.replies[rank][2] for rank in range(self.world_size)]

    def _collect(self, workers: WorkerProcesses, task_id: int | None, timeout: float) -> _Outcome:
        """Wait for every rank's answer, a death, or the deadline; never raises for a rank."""
        pending = set(range(len(workers.procs)))
        replies: dict[int, tuple[Any, ...]] = {}
        died: dict[int, int | None] = {}
        deadline = time.monotonic() + timeout
        grace_deadline: float | None = None
        while pending:
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            waitables: list[Any] = []
            for rank in pending:
                waitables += [workers.conns[rank], workers.procs[rank].sentinel]
            ready = set(multiprocessing.connection.wait(waitables, remaining))
            for rank in sorted(pending):
                conn, proc = workers.conns[rank], workers.procs[rank]
                if conn not in ready and proc.sentinel not in ready:
                    continue
                reply = _read_reply(conn, task_id)
                if reply == "stale":
                    continue
                if reply is None:  # no answer and the process is gone
                    proc.join(REAP_TIMEOUT)
                    died[rank] = proc.exitcode
                else:
                    replies[rank] = reply
                pending.discard(rank)
            failed = died or any(r[0] != "ok" for r in replies.values())
            if failed and grace_deadline is None:
                grace_deadline = time.monotonic() + self.error_grace
        return _Outcome(replies=replies, died=died, silent=sorted(pending))

    def _raise_for(self, outcome: _Outcome, workers: WorkerProcesses, *, what: str, timeout: float, task: bool) -> None:
        """Turn a failed outcome into the right exception, killing the workers when needed."""
        errors = {r: reply for r, reply in sorted(outcome.replies.items()) if reply[0] != "ok"}
        if not errors and not outcome.died and not outcome.silent:
            return
        world = len(workers.procs)
        pids = workers.pids()
        failures: dict[int, str] = {}
        exceptions: dict[int, BaseException] = {}
        for rank, reply in errors.items():
            failures[rank] = str(reply[2])
            if reply[3] is not None:
                with contextlib.suppress(Exception):
                    exceptions[rank] = pickle.loads(reply[3])
        for rank, code in outcome.died.items():
            failures[rank] = f"rank {rank} (pid {pids[rank]}) died ({_signal_name(code)})"
            if not task:
                failures[rank] += (
                    " while starting; its stderr (above, or in the captured output) says why. A script"
                    " that starts a pool must do so under `if __name__ == '__main__':` (spawn start method)."
                )
        results = {r: reply[2] for r, reply in outcome.replies.items() if reply[0] == "ok" and task}
        stacks = dump_stacks(workers, outcome.silent) if outcome.silent else {}
        killed = bool(outcome.died or outcome.silent)
        if killed:
            self._state.kill_workers()
        elif task and not self._probe(workers):
            killed = True
            self._state.kill_workers()

        failing = sorted(set(errors) | set(outcome.died))
        lines: list[str] = []
        if outcome.died:
            dead = ", ".join(f"rank {r} ({_signal_name(c)})" for r, c in sorted(outcome.died.items()))
            lines.append(f"{what} failed: worker died: {dead}")
        elif errors:
            lines.append(f"{what} failed on rank(s) {failing} of {world}")
        else:
            lines.append(f"{what} timed out: rank(s) {outcome.silent} of {world} did not answer within {timeout:g} s")
        for rank in failing:
            lines += ["", f"--- rank {rank} ---", _clip(failures[rank]).rstrip()]
        if outcome.silent and failing:
            lines += [
                "",
                f"rank(s) {outcome.silent} were still running {self.error_grace:g} s after the failure "
                "(probably waiting in a collective for a failed rank)",
            ]
        for rank in outcome.silent:
            stack = stacks.get(rank) or "(no stack dump)"
            if not failing:
                failures[rank] = f"rank {rank} did not answer within {timeout:g} s\n{stack}"
            lines += ["", f"--- rank {rank}: Python stack when it was killed ---", _clip(stack).rstrip()]
        if killed:
            lines += ["", "the workers were killed; the pool starts new ones on the next run"]
        message = "\n".join(lines)
        kwargs: dict[str, Any] = dict(
            failures=failures, stuck=outcome.silent, stacks=stacks, results=results, exceptions=exceptions
        )
        if outcome.died:
            raise WorkerDied(message, exitcodes=outcome.died, **kwargs)
        if errors:
            raise WorkerError(message, **kwargs)
        raise PoolTimeout(message, **kwargs)

    def _probe(self, workers: WorkerProcesses) -> bool:
        """After a task failed on some ranks but all answered: is the process group still usable?"""
        task_id = next(self._task_ids)
        message = pickle.dumps(("probe", task_id), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in workers.conns:
                conn.send_bytes(message)
        except OSError:
            return False
        outcome = self._collect(workers, task_id, max(self.error_grace, 1.0))
        return (
            not outcome.died
            and not outcome.silent
            and all(reply[0] == "ok" and reply[4] for reply in outcome.replies.values())
        )


@contextlib.contextmanager
def checked_pool(world_size: int, **options: Any) -> Iterator[WorkerPool]:
    """A :class:`WorkerPool` (``options`` as its own) that is closed on exit and must leave no
    process behind — the body of a pool fixture (``with checked_pool(4) as pool: yield pool``)."""
    pool = WorkerPool(world_size=world_size, **options)
    try:
        yield pool
    finally:
        pool.close()
        left = leftover_processes(sorted(pool.started_pids))
        assert not left, f"the {world_size}-rank worker pool left processes behind: {left}"


def _read_reply(conn: multiprocessing.connection.Connection, task_id: int | None) -> Any:
    """The reply waiting on ``conn``; ``None`` if the worker is gone; ``"stale"`` for an old one."""
    try:
        if not conn.poll(0):
            return None
        data = conn.recv_bytes()
    except (EOFError, OSError):
        return None
    try:
        reply = pickle.loads(data)
    except BaseException:  # noqa: BLE001 -- e.g. the result's class does not exist here
        return ("error", task_id, "the rank's answer could not be unpickled:\n" + traceback.format_exc(), None, True)
    if reply[1] != task_id:
        return "stale"
    return reply


def _task_name(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}"


def _pickle_task(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    if not callable(fn):
        raise TypeError(f"WorkerPool.run needs a callable, got {fn!r}")
    try:
        return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"cannot send task {_task_name(fn)} to the workers: {exc}. Tasks travel with plain "
            "pickle: the function must be defined at module level of an importable module (not a "
            "lambda, closure or nested function) and its arguments must be picklable."
        ) from exc
