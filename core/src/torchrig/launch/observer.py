"""What the launcher saw of each attempt: the ranks' pids, exact exit times, when teardown began.

:class:`Observer` merges those observations with the ranks' status files into the rank records
from which :mod:`torchrig.launch.summary` names the first failing rank. Separate from the agent
(:mod:`torchrig.launch.elastic`), which only tells it when an attempt starts and ends: the
bookkeeping is plain Python over pids and files, readable without elastic's agent in mind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from torch.distributed.elastic.multiprocessing import Std

from torchrig.launch import status as _status
from torchrig.launch import summary as _summary
from torchrig.plugin.types import LaunchPlan
from torchrig.resilience import hang_report


class Observer:
    """What the launcher saw of each attempt: pids, exact exit times, when teardown began."""

    def __init__(self, plan: LaunchPlan, log_dir: str) -> None:
        self.plan, self.log_dir = plan, log_dir
        self.attempts: list[dict[str, Any]] = []
        # Re-entrant: forward() runs in a signal handler, on the main thread, which may hold it already.
        self.lock = threading.RLock()
        #: Signals to pass on that arrived while no rank was running (delivered by :meth:`started`).
        self.pending: list[int] = []
        self._reset()

    def _reset(self) -> None:
        self.attempt: int | None = None
        self.ranks: dict[int, int] = {}  # local rank -> global rank
        self.pids: dict[int, int] = {}
        self.exits: dict[int, tuple[float, int | None, int | None]] = {}  # local rank -> (time, code, signal)
        self.started_at = 0.0
        self.teardown_at: float | None = None
        self.teardown_signal: str | None = None
        self.ended = True

    def before_start(self, attempt: int, ranks: Mapping[int, int]) -> None:
        """Forget the previous attempt's status files so a rank that never starts is not
        mistaken for one that did (nor an old hang dump for this attempt's)."""
        hang_report.forget_dumps(self.log_dir, ranks.values())
        for rank in ranks.values():
            try:
                os.unlink(_status.rank_status_path(self.log_dir, rank))
            except OSError:
                pass

    def started(self, attempt: int, ranks: Mapping[int, int], pids: Mapping[int, int]) -> None:
        with self.lock:
            self._reset()
            self.attempt, self.ranks, self.pids = attempt, dict(ranks), dict(pids)
            self.started_at, self.ended = time.time(), False
            pending, self.pending = self.pending, []
        for signum in pending:
            self.forward(signum)
        for local_rank, pid in pids.items():
            threading.Thread(target=self._wait_exit, args=(local_rank, pid), daemon=True,
                             name=f"torchrig-exit-{local_rank}").start()

    def _wait_exit(self, local_rank: int, pid: int) -> None:
        """Block until the worker exits (without reaping it: elastic's Popen does) and note the time."""
        try:
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        except (ChildProcessError, OSError):
            return
        now = time.time()
        if info is None:
            return
        code, sig = (info.si_status, None) if info.si_code == os.CLD_EXITED else (None, info.si_status)
        with self.lock:
            if self.pids.get(local_rank) == pid:
                self.exits.setdefault(local_rank, (now, code, sig))

    def forward(self, signum: int) -> None:
        """Send ``signum`` to each rank's supervisor, which passes it on to the rank (without a
        supervisor the rank is this pid) — not to the process group: the processes a rank started
        (DataLoader workers) would die of it."""
        with self.lock:
            pids = list(self.pids.values()) if not self.ended else []
            if not pids:
                self.pending.append(signum)  # no rank yet: passed on when the next attempt starts
        for pid in pids:
            try:
                os.kill(pid, signum)
            except OSError:
                pass

    def last_commit(self) -> str | None:
        """The checkpoint this node's ranks of the current attempt last committed, as
        ``path@inode.mtime`` (a checkpoint saved again under the same name is another commit), or
        None: read from their status files (``last_checkpoint``)."""
        with self.lock:
            ranks = list(self.ranks.values())
        newest: tuple[int, str] | None = None
        for rank in ranks:
            path = (_status.read_json(_status.rank_status_path(self.log_dir, rank)) or {}).get("last_checkpoint")
            try:
                stat = os.stat(path) if path else None
            except OSError:
                continue  # rotated away since: a newer one was committed
            if stat is not None and (newest is None or stat.st_mtime_ns > newest[0]):
                newest = (stat.st_mtime_ns, f"{path}@{stat.st_ino}.{stat.st_mtime_ns}")
        return newest[1] if newest else None

    def teardown(self, death_sig: Any) -> None:
        with self.lock:
            if self.teardown_at is None and not self.ended:
                self.teardown_at = time.time()
                self.teardown_signal = signal.Signals(death_sig or signal.SIGTERM).name

    def end(self, failures: Mapping[int, Any] | None = None, *, launcher_signal: str | None = None) -> dict[str, Any] | None:
        """Close the current attempt: merge status files and observations into rank records."""
        with self.lock:
            if self.ended or self.attempt is None:
                return None
            self.ended = True
        time.sleep(0.01)  # let the exit threads of processes that just ended record their time
        records = [self._record(lr, gr, (failures or {}).get(gr), failures is not None)
                   for lr, gr in sorted(self.ranks.items())]
        verdict = _summary.analyze(records, launcher_signal=launcher_signal)
        self._diagnose_hang(verdict)
        attempt = {"attempt": self.attempt, "started_at": self.started_at, "ended_at": time.time(),
                   "teardown_at": self.teardown_at, "teardown_signal": self.teardown_signal,
                   "verdict": verdict, "ranks": records}
        self.attempts.append(attempt)
        return attempt

    def _diagnose_hang(self, verdict: dict[str, Any]) -> None:
        """A collective timed out: compare the ranks' hang dumps, say which collective each rank is
        in (printed now, kept in ``run_status.json``'s attempt as ``hang``)."""
        ranks = sorted(self.ranks.values())
        diagnosis = hang_report.diagnose(hang_report.load_dumps(self.log_dir, ranks, self.attempt), ranks)
        if diagnosis is None:
            return
        verdict["hang"] = diagnosis
        print(f"torchrig launch: hang diagnosis: {diagnosis['text']} (per-rank dumps: "
              f"{os.path.join(self.log_dir, 'rank-N.hang.json')})", file=sys.stderr, flush=True)

    def _record(self, local_rank: int, rank: int, failure: Any, failures_known: bool) -> dict[str, Any]:
        status = _status.read_json(_status.rank_status_path(self.log_dir, rank)) or {}
        if status.get("attempt") not in (None, self.attempt):
            status = {}
        seen = self.exits.get(local_rank)
        record: dict[str, Any] = {
            "rank": rank, "local_rank": local_rank, "node_rank": self.plan.node_rank, "pid": self.pids.get(local_rank),
            "attempt": self.attempt, "state": status.get("state") or _status.RUNNING,
            "started_at": status.get("started_at"), "ended_at": status.get("ended_at"),
            "exit_code": status.get("exit_code"), "signal": status.get("signal"), "error": status.get("error"),
            "traceback": status.get("traceback"), "stderr_tail": status.get("stderr_tail"),
            "warnings": status.get("warnings") or [],
            "logs": self._logs(rank),
        }
        for extra in ("trackers", "last_checkpoint", "preempted", "waiting", "rollback"):  # run_status.record(...)
            if status.get(extra) is not None:
                record[extra] = status[extra]
        if record["state"] == _status.RUNNING:  # the wrapper never wrote its end: killed, or no wrapper
            self._from_exit(record, seen, failure, failures_known)
        elif record["state"] == _status.FAILED and seen and record["ended_at"] is None:
            record["ended_at"] = seen[0]
        return record

    def _from_exit(self, record: dict[str, Any], seen: tuple[float, int | None, int | None] | None, failure: Any,
                   failures_known: bool) -> None:
        """A rank's fate from its exit status alone (it was killed, or runs without the wrapper)."""
        sig = None
        if seen is not None:
            when, code, sig = seen[0], seen[1], seen[2]
        elif failure is not None:
            when, code = float(failure.timestamp), failure.exitcode
            if code < 0:
                code, sig = None, -code
        else:  # elastic saw it exit 0 (it reports every other exit as a failure) or never saw it end
            when, code = time.time(), 0 if failures_known else None
        if sig:
            code = 128 + sig
            record["signal"] = signal.Signals(sig).name
        record.update(ended_at=when, exit_code=code)
        if code == 0:
            record["state"] = _status.FINISHED
        elif code is None or (self.teardown_at is not None and when >= self.teardown_at):
            record["state"] = _status.TERMINATED
        else:
            record["state"] = _status.FAILED
            record["error"] = (f"killed by {record['signal']} (no Python traceback: the process was killed)"
                               if sig else f"exited with code {code}")
            if not record["stderr_tail"] and record["logs"].get("stderr"):
                record["stderr_tail"] = _status.read_tail(record["logs"]["stderr"]) or None
            if not record["traceback"] and failure is not None:
                record["traceback"] = _error_file_callstack(failure)

    def _logs(self, rank: int) -> dict[str, str]:
        directory = os.path.join(self.log_dir, f"attempt-{self.attempt}")
        logs = {}
        for stream, bit in (("stdout", Std.OUT), ("stderr", Std.ERR)):
            if self.plan.tee & bit:
                logs[stream] = os.path.join(directory, f"rank-{rank}.{stream}.log")
        return logs


def _error_file_callstack(failure: Any) -> str | None:
    message = (getattr(failure, "error_file_data", None) or {}).get("message")
    if isinstance(message, dict):
        return _status.tail(message.get("extraInfo", {}).get("py_callstack") or "") or None
    return None



__all__ = ["Observer"]
