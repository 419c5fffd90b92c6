"""The elastic agent behind ``notebook_launcher``, and what each forked rank runs first.

Why not torch's ``elastic_launch``: a notebook outlives every launch, so what a launch leaves
behind stays for the whole session. Measured with torch 2.13's ``elastic_launch`` (forked ranks):

* processes a rank started (a ``subprocess``, a ``multiprocessing`` child, a ``setsid`` daemon)
  outlived it, and a non-daemon ``multiprocessing`` child made the rank wait for it at exit, so
  the launch never returned;
* a rank that left through ``os._exit(0)`` sent no return value, so elastic waited for it forever;
* its SIGINT/SIGTERM handlers stayed installed after the launch (the next Ctrl-C in the notebook
  raised torch's ``SignalException``);
* the traceback files ``torch.multiprocessing`` creates (``pytorch-errorfile-*``) were never removed.

So each rank runs under the supervisor ``torchrig launch`` uses (:mod:`torchrig.launch.supervisor`:
a subreaper that ends the rank's whole tree when the rank ends, and with the notebook), ends the
processes it started itself before it returns (so nothing makes it wait), and the agent below
names a rank that exited 0 without returning, tears the others down within a short grace, and
hands back the files torch created for this launch so that exactly those are removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from torchrig.launch.supervisor import LEFTOVER_GRACE_S, descendants, end_tree, set_parent_death_signal, supervise

#: Seconds the supervisor gives a rank after a stop signal before it SIGKILLs the rank's tree.
RANK_KILL_GRACE_S = 5.0
#: Seconds the agent waits for the ranks after a stop signal before its own SIGKILL (above the
#: supervisor's grace, so a supervisor is never killed before it ended its tree).
TEARDOWN_GRACE_S = 10.0


class LeftEarly(ProcessFailure):
    """A rank that exited with code 0 without returning from the function (``os._exit(0)``,
    ``sys.exit(0)``): it sent no return value, and elastic would wait for it forever."""

    left_early = True

    def __init__(self, local_rank: int, pid: int, function_name: str) -> None:
        super().__init__(local_rank=local_rank, pid=pid, exitcode=0, error_file="")
        self.message = (f"exited with code 0 without returning from {function_name!r} (sys.exit(0) or os._exit(0) "
                        "inside the function?)")


class NotebookAgent(LocalElasticAgent):
    """``LocalElasticAgent`` for forked ranks: notices ranks that leave early, tears down within
    :data:`TEARDOWN_GRACE_S`, and keeps the names of the traceback files torch made for it."""

    def __init__(self, *args: Any, function_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.function_name = function_name
        #: ``torch.multiprocessing``'s ``pytorch-errorfile-*`` files of this launch (never removed by torch).
        self.error_files: list[str] = []
        #: Every rank's pid (its supervisor's), all attempts: what :meth:`sweep` ends.
        self.rank_pids: list[int] = []

    def sweep(self) -> None:
        """SIGKILL whatever is left of every rank's tree (after a teardown that was itself
        interrupted, e.g. a second Ctrl-C): the tree below a supervisor, then the supervisor."""
        for _ in range(100):
            roots = [pid for pid in self.rank_pids if _running_child_of_ours(pid)]  # never a reused pid
            left = [pid for root in roots for pid in (*descendants(root), root)]
            if not left:
                return
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids = super()._start_workers(worker_group)
        self.rank_pids += list(pids.values())
        context = self._pcontext
        assert context is not None
        processes = getattr(context, "_pc", None)
        self.error_files += [path for path in getattr(processes, "error_files", None) or [] if path]
        close = context.close

        def close_within_grace(death_sig: Any = None, timeout: float = TEARDOWN_GRACE_S) -> None:
            close(death_sig, min(timeout, TEARDOWN_GRACE_S))  # type: ignore[arg-type]

        context.close = close_within_grace  # type: ignore[method-assign]
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        left = self._left_early(worker_group)
        if left:
            return RunResult(state=WorkerState.FAILED, failures=dict(left))
        return super()._monitor_workers(worker_group)

    def _left_early(self, worker_group: WorkerGroup) -> dict[int, LeftEarly]:
        """Ranks that exited 0 while the others have not all returned: a rank that returns waits
        for elastic to read every return value (``_worker_finished_event``) before it exits."""
        context = self._pcontext
        processes = getattr(context, "_pc", None)
        finished = getattr(context, "_worker_finished_event", None)
        if processes is None or finished is None or finished.is_set():
            return {}
        left = {}
        for local_rank, process in enumerate(processes.processes):
            if process.exitcode == 0:
                rank = worker_group.workers[local_rank].global_rank
                left[rank] = LeftEarly(local_rank, process.pid, self.function_name)
        return left


def _running_child_of_ours(pid: int) -> bool:
    """A live (not zombie) child of this process: a supervisor of this launch, not a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            fields = handle.read().decode(errors="replace").rpartition(")")[2].split()
    except OSError:
        return False
    return len(fields) > 1 and fields[0] not in ("Z", "X", "x") and int(fields[1]) == os.getpid()


def rank_entry(function: Callable[..., Any], *args: Any) -> Any:
    """What a forked rank runs: supervised (its tree dies with it and with the notebook), then the
    function; the processes it started end before it returns, so none can make it wait at exit
    (``multiprocessing`` joins non-daemon children) and none outlives the launch."""
    # Python's own handlers, not the ones torch's agent installed in the notebook before forking: a
    # Ctrl-C is a KeyboardInterrupt in the function too (the function's `except KeyboardInterrupt` runs).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    supervise(RANK_KILL_GRACE_S, forward_stop_signals=True)  # returns in the rank; the supervisor never returns
    set_parent_death_signal()
    try:
        result = function(*args)
    except SystemExit as exc:  # torch counts sys.exit(0) as a return (of None): leave as os._exit would
        _end_own_processes()
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except BaseException:
        _end_own_processes()
        raise
    _end_own_processes()
    return result


def _end_own_processes() -> None:
    end_tree(os.getpid(), grace=LEFTOVER_GRACE_S)


__all__ = ["RANK_KILL_GRACE_S", "TEARDOWN_GRACE_S", "LeftEarly", "NotebookAgent", "rank_entry"]
