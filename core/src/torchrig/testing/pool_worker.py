"""The worker side of :class:`~torchrig.testing.pool.WorkerPool`: the code that runs inside each
pooled rank — start-up (own session, parent-death signal, the process group), then serving the
tasks the parent sends, answering each with its value or its traceback.

Separate from :mod:`torchrig.testing.pool` (the parent side: spawning, timeouts, killing,
reporting) because the two halves run in different processes and meet only at the messages
documented in :func:`worker_main`; a spawned rank imports this module alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import importlib
import multiprocessing.connection
import os
import pickle
import signal
import sys
import tempfile
import traceback
from typing import Any

import attrs

from torchrig.testing.scripts import load_script

__all__ = ["WorkerContext", "WorkerSpec", "send_message", "worker_main"]

_PR_SET_PDEATHSIG = 1


@attrs.frozen
class WorkerContext:
    """What a task learns about the rank it runs on; passed as its first argument."""

    #: This worker's rank in the default process group.
    rank: int
    #: Number of ranks in the pool (and in the default process group).
    world_size: int
    #: A temporary directory shared by every rank of the pool. It survives across tasks and
    #: across restarts of the same pool (a fault-injection test can write a checkpoint, kill a
    #: rank, and resume from it), and is deleted by :meth:`WorkerPool.close`.
    scratch_dir: str


@attrs.frozen
class WorkerSpec:
    """Everything a worker needs to start; pickled into the spawned process."""

    rank: int
    world_size: int
    backend: str
    store_path: str
    scratch_dir: str
    stack_path: str
    collective_timeout: float
    env: dict[str, str]
    sys_path: list[str]
    cwd: str
    parent_pid: int


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no-op where unsupported)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _chdir(path: str) -> None:
    with contextlib.suppress(OSError):
        if os.getcwd() != path:
            os.chdir(path)


def send_message(conn: multiprocessing.connection.Connection, message: tuple[Any, ...]) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _import_task_module(name: str | None, path: str | None) -> None:
    """Make the task's module importable before unpickling the task.

    With pytest's default import mode ``sys.path`` (already synced) suffices; under
    ``--import-mode=importlib`` the module is not on ``sys.path``, so load it from its file
    under the same name.
    """
    if not name or name in sys.modules or name in ("__main__", "__mp_main__"):
        return
    try:
        importlib.import_module(name)
        return
    except ImportError:
        if not path:
            raise
    load_script(path, name)


def _error_reply(
    task_id: int | None, exc: BaseException | None, pg_alive: bool, *, skip_frames: int = 0
) -> tuple[Any, ...]:
    text = traceback.format_exc()
    if exc is not None and skip_frames:
        tb = exc.__traceback__
        for _ in range(skip_frames):
            if tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    exc_bytes = None
    if exc is not None:
        try:
            exc_bytes = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # noqa: BLE001 -- any pickling problem just means "no object"
            exc_bytes = None
    return ("error", task_id, text, exc_bytes, pg_alive)


def worker_main(spec: WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    """Entry point of a worker: join the process group, then serve tasks until told to exit.

    Messages (each one pickled with plain pickle and sent with ``send_bytes``):
    parent -> worker: ``("run", task_id, sys_path, cwd, module, module_file, payload)``,
    ``("probe", task_id)``, ``("exit",)``; worker -> parent:
    ``("ok", task_id, value, None, pg_alive)`` or ``("error", task_id, traceback, exc, pg_alive)``
    (``task_id`` is ``None`` for the start-up answer, whose value is the worker's pid).
    """
    with contextlib.suppress(OSError):
        os.setsid()  # own process group + session: killpg reaches everything it starts
    _set_parent_death_signal()
    if os.getppid() != spec.parent_pid:  # the parent died before prctl took effect
        os._exit(1)
    os.environ.update(spec.env)
    # What tasks create through ``tempfile`` lives in the pool's directory, removed when the pool
    # closes: also what a task leaves when it kills its own rank before its cleanup runs.
    tempfile.tempdir = os.path.join(os.path.dirname(spec.scratch_dir), "tmp")
    os.makedirs(tempfile.tempdir, exist_ok=True)
    sys.path[:] = spec.sys_path
    _chdir(spec.cwd)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    stack_file = open(spec.stack_path, "w")  # noqa: SIM115 -- lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)

    try:
        import torch.distributed as dist

        store = dist.FileStore(spec.store_path, spec.world_size)
        dist.init_process_group(
            spec.backend,
            store=store,
            rank=spec.rank,
            world_size=spec.world_size,
            timeout=datetime.timedelta(seconds=spec.collective_timeout),
        )
        dist.barrier()  # every connection is up before the pool reports ready
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent, which raises
        with contextlib.suppress(OSError):
            send_message(conn, _error_reply(None, exc, False))
        return

    ctx = WorkerContext(rank=spec.rank, world_size=spec.world_size, scratch_dir=spec.scratch_dir)
    try:
        send_message(conn, ("ok", None, os.getpid(), None, True))
        _serve(conn, ctx, dist)
    except (EOFError, OSError):
        pass  # the parent went away: just leave
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    _leave_without_teardown()


def _leave_without_teardown() -> None:
    """End the worker now, skipping the interpreter's teardown: unloading torch's modules costs
    ~0.6 s of CPU per rank (1-3 s of wall time per pool close on 2 cores), and there is nothing
    left to save — the parent reads no exit hook's output and SIGKILLs the rank's process group
    right after (what a task started is swept there)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _serve(conn: multiprocessing.connection.Connection, ctx: WorkerContext, dist: Any) -> None:
    while True:
        message = pickle.loads(conn.recv_bytes())
        kind = message[0]
        if kind == "exit":
            return
        task_id = message[1]
        if kind == "probe":
            try:
                dist.barrier()
                reply: tuple[Any, ...] = ("ok", task_id, None, None, dist.is_initialized())
            except BaseException as exc:  # noqa: BLE001
                reply = _error_reply(task_id, exc, dist.is_initialized())
        elif kind == "run":
            reply = _run_task(ctx, dist, *message[1:])
        else:
            reply = ("error", task_id, f"unknown message {kind!r}", None, dist.is_initialized())
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        try:
            send_message(conn, reply)
        except (EOFError, OSError):
            raise
        except BaseException as exc:  # noqa: BLE001 -- the result could not be pickled
            try:
                raise TypeError(
                    f"rank {ctx.rank}: the task's result could not be pickled to send it back: {exc!r}"
                ) from exc
            except TypeError as wrapped:
                send_message(conn, _error_reply(task_id, wrapped, dist.is_initialized()))
        del reply


def _run_task(
    ctx: WorkerContext,
    dist: Any,
    task_id: int,
    sys_path: list[str],
    cwd: str,
    module: str | None,
    module_file: str | None,
    payload: bytes,
) -> tuple[Any, ...]:
    if sys.path != sys_path:
        sys.path[:] = sys_path
    _chdir(cwd)
    try:
        _import_task_module(module, module_file)
        fn, args, kwargs = pickle.loads(payload)
        value = fn(ctx, *args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 -- every failure is reported, even SystemExit
        # skip_frames=1: the traceback starts at the task, not at this harness function
        return _error_reply(task_id, exc, dist.is_initialized(), skip_frames=1)
    return ("ok", task_id, value, None, dist.is_initialized())
