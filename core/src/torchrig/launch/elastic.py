"""The core's default launch: torch.distributed.elastic, the engine torchrun uses.

``torchrig launch`` builds a :class:`~torchrig.types.LaunchPlan`; this module runs the workers of
this node with elastic's ``LocalElasticAgent`` — not a home-made spawner — and a c10d rendezvous
across machines (one machine needs none: :class:`SingleNodeRendezvous`), and adds what torchrun lacks (see ``docs``/REFERENCE "Launch"):

* **A fresh master port per attempt.** By default elastic shares its rendezvous TCPStore with
  the workers, so every restart reuses one ``MASTER_PORT`` and the keys the previous attempt's
  gloo ranks left in it. Measured here (torch 2.13, 2 CPU workers, the first attempt failing
  once): ``torchrun --standalone --max_restarts 1`` finished in only 5 of 15 runs (``Gloo
  connectFullMesh failed ... Connection refused``; one run hung). We set
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` and publish a new free port for every rendezvous
  round through the round's store: 16 of 16 runs finished (6 torchrun, 10 torchrig launch),
  each attempt on a different port; the tests repeat it.
* **``--machine_rank`` is the node rank.** c10d rendezvous numbers nodes by join order; a thin
  handler (:class:`MachineRankRendezvous`) makes each node's group rank its machine rank, so
  ``RANK = machine_rank * nproc_per_node + local_rank`` as with Accelerate, and checks that
  every machine rank is used exactly once.
* **Failures are named.** The agent records when each worker exited (``waitid`` as it happens,
  so a rank killed by a signal has an exact time too) and when the launcher began tearing the
  others down; with the wrappers' status files that names the first failing rank
  (:mod:`torchrig.launch.summary`), printed and merged into ``<log_dir>/run_status.json``.
* **Signals.** SIGINT/SIGTERM/SIGHUP reach the launcher, are forwarded to every worker, which
  are SIGKILLed after ``plan.shutdown_grace_s``; the exit code is 128 + the signal (130, 143).
  SIGUSR1 is passed on to every rank and tears nothing down (a preemption warning); ranks that
  stopped after a preemption checkpoint are not restarted, and the launcher exits with their
  code (75 by default). A SIGUSR1 that arrived before the ranks existed (held from the entry
  point's first line, :mod:`torchrig.launch.held_signals`) is passed on as soon as they do. The
  ranks are started with SIGUSR1 blocked, so one that reaches a rank while its interpreter is
  still starting stays pending until the wrapper has installed its handler (then unblocks it).
* **Quiet.** Elastic's own log lines (``Sending process ... closing signal``) are hidden unless
  ``TORCHRIG_LOG_LEVEL`` is DEBUG or INFO; the summary says what happened.

Imports torch: only called from the ``torchrig_launch`` hook.
"""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import signal
import socket
import string
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Mapping
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException, Std
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from torchrig.launch import held_signals
from torchrig.launch import status as _status
from torchrig.launch import summary as _summary
from torchrig.launch.tail import LogRelay
from torchrig.types import LaunchPlan

#: Console prefix of each worker's output lines (a ``string.Template`` of ``rank``).
LOG_LINE_PREFIX = "[rank${rank}]: "
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Passed on to every rank, nothing torn down: a scheduler's warning (Slurm ``--signal=USR1@T``)
#: that the ranks turn into a preemption checkpoint (:mod:`torchrig.preemption`).
FORWARDED_SIGNAL = signal.SIGUSR1


def free_port(host: str = "") -> int:
    """A port nobody listens on right now (bind to 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class SingleNodeRendezvous(RendezvousHandler):
    """One machine: no peer to wait for, so no c10d rendezvous round (whose join path sleeps a
    random fraction of a second). Every attempt gets a new TCPStore, hosted by the agent on a
    fresh loopback port before any worker starts: the workers connect to a store that is already
    listening (no connect retries, as with torchrun), and a restart never meets the keys of the
    attempt before it (the reason torchrig does not share one store across attempts)."""

    def __init__(self, run_id: str, first_port: int = 0, timeout_s: float = 900.0) -> None:
        self.run_id = run_id
        self.first_port = first_port  # main_process_port, when given: the first attempt's master port
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store: Any = None
        self._attempt = 0
        self._closed = False

    def next_rendezvous(self) -> RendezvousInfo:
        from torch.distributed import PrefixStore, TCPStore

        self._attempt += 1
        port = self.first_port if self._attempt == 1 else 0
        self._store = TCPStore("127.0.0.1", port, None, True, self.timeout, wait_for_workers=False,
                               multi_tenant=True)
        store = PrefixStore(self.run_id, self._store)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo("127.0.0.1", int(self._store.port)))

    def get_backend(self) -> str:
        return "torchrig-single-node"

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers' process group uses this attempt's store (they connect as clients)

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        self._store = None
        return True


class MachineRankRendezvous(RendezvousHandler):
    """A c10d rendezvous whose node ranks are the machines' ``--machine_rank`` and whose
    master port is new for every round (so every restart gets a fresh one)."""

    def __init__(self, inner: RendezvousHandler, machine_rank: int, master_addr: str) -> None:
        self.inner = inner
        self.machine_rank = machine_rank
        self.master_addr = master_addr

    def next_rendezvous(self) -> RendezvousInfo:
        info = self.inner.next_rendezvous()
        store, size = info.store, info.world_size
        store.set(f"torchrig/machine_rank/{info.rank}", str(self.machine_rank))
        claimed = sorted(int(store.get(f"torchrig/machine_rank/{i}").decode()) for i in range(size))
        if claimed != list(range(size)):
            raise RendezvousError(
                f"the {size} machines joined with machine ranks {claimed}; each of 0..{size - 1} must be used "
                "exactly once (check --machine_rank on every machine)")
        if self.machine_rank == 0:
            store.set("torchrig/master", f"{self.master_addr}:{free_port()}")
        addr, _, port = store.get("torchrig/master").decode().rpartition(":")
        return RendezvousInfo(store, self.machine_rank, size, RendezvousStoreInfo(addr, int(port)))

    # everything else is the c10d handler's
    def get_backend(self) -> str:
        return self.inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()


class TorchrigLogsSpecs(LogsSpecs):
    """Per-rank files named by global rank: ``<log_dir>/attempt-K/rank-N.{stdout,stderr}.log``
    and elastic's error file ``rank-N.error.json``. Tee'd streams are printed by the launcher
    with the ``[rankN]: `` prefix by :meth:`relay` (not by elastic's tailer, which breaks
    progress bars: :mod:`torchrig.launch.tail`)."""

    def __init__(self, log_dir: str, tee: int) -> None:
        super().__init__(log_dir=log_dir, tee=Std(tee))
        self.tee = Std(tee)
        self._entries: list[tuple[str, str, Any]] = []

    def relay(self) -> LogRelay:
        """A relay of the files of the attempt :meth:`reify` set up last (not started)."""
        return LogRelay(self._entries)

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        attempt = next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", "0")
        directory = os.path.join(self.root_log_dir, f"attempt-{attempt}")
        os.makedirs(directory, exist_ok=True)
        dest = LogsDest()
        self._entries = []
        for local_rank, env in envs.items():
            rank = env.get("RANK", local_rank)
            stem = os.path.join(directory, f"rank-{rank}")
            prefix = string.Template(LOG_LINE_PREFIX).safe_substitute(rank=rank)
            dest.stdouts[local_rank] = f"{stem}.stdout.log" if self.tee & Std.OUT else ""
            dest.stderrs[local_rank] = f"{stem}.stderr.log" if self.tee & Std.ERR else ""
            if self.tee & Std.OUT:
                self._entries.append((dest.stdouts[local_rank], prefix, sys.stdout))
            if self.tee & Std.ERR:
                self._entries.append((dest.stderrs[local_rank], prefix, sys.stderr))
            dest.error_files[local_rank] = f"{stem}.error.json"
            env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
            for path in (dest.stdouts[local_rank], dest.stderrs[local_rank], dest.error_files[local_rank]):
                if path and os.path.exists(path):
                    os.unlink(path)
        dest.filtered_stdout = os.path.join(directory, "filtered_stdout.log")
        dest.filtered_stderr = os.path.join(directory, "filtered_stderr.log")
        return dest


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
        mistaken for one that did."""
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
        attempt = {"attempt": self.attempt, "started_at": self.started_at, "ended_at": time.time(),
                   "teardown_at": self.teardown_at, "teardown_signal": self.teardown_signal,
                   "verdict": verdict, "ranks": records}
        self.attempts.append(attempt)
        return attempt

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
        for extra in ("trackers", "last_checkpoint", "preempted", "waiting"):  # run_status.record(...) in the rank
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


class TorchrigAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that tells the :class:`Observer` about each attempt and tears
    workers down within ``grace`` seconds (elastic waits 30 s before SIGKILL)."""

    def __init__(self, *args: Any, observer: Observer, grace: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.observer, self.grace = observer, grace

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        attempt = spec.max_restarts - self._remaining_restarts
        ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        self.observer.before_start(attempt, ranks)
        # The ranks inherit this mask: a SIGUSR1 reaching one before its wrapper installed the
        # handler stays pending (the wrapper unblocks it). Here, it waits until the pids are known.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {FORWARDED_SIGNAL})
        try:
            pids = super()._start_workers(worker_group)
            self._watch_attempt(worker_group, attempt, ranks, pids)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return pids

    def _watch_attempt(self, worker_group: WorkerGroup, attempt: int, ranks: Mapping[int, int],
                       pids: Mapping[int, int]) -> None:
        """Teardown within the grace, the log relay, and the observer told about the new pids."""
        context, observer, grace = self._pcontext, self.observer, self.grace
        assert context is not None
        original = context.close
        relay = self._logs_specs.relay().start() if isinstance(self._logs_specs, TorchrigLogsSpecs) else None

        def close(death_sig: Any = None, timeout: float = grace) -> None:
            observer.teardown(death_sig)
            try:
                original(death_sig, min(timeout, grace))
            finally:
                if relay is not None:
                    relay.stop()  # after the workers ended: what they wrote last is printed too

        context.close = close  # type: ignore[method-assign]
        self.observer.started(attempt, ranks, pids)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.UNHEALTHY):
            attempt = self.observer.end(result.failures)
            if attempt and attempt["verdict"]["state"] == _status.PREEMPTED:
                self._remaining_restarts = 0  # the job is being taken away: resuming is the scheduler's (or the user's) call
            elif attempt and result.state is not WorkerState.SUCCEEDED and self._remaining_restarts > 0:
                print(f"torchrig launch: attempt {attempt['attempt']} failed: {attempt['verdict']['headline']}; "
                      f"restarting ({worker_group.spec.max_restarts - self._remaining_restarts + 1} of "
                      f"{worker_group.spec.max_restarts})", file=sys.stderr, flush=True)
        return result


def _pass_on_held_signals(observer: Observer) -> None:
    """SIGUSR1 held since the entry point goes to the ranks once they exist; a held stop signal
    stops the launch here, before any worker starts (raised as if it arrived now)."""
    for signum in held_signals.take():
        if signum == FORWARDED_SIGNAL:
            observer.forward(signum)
        else:
            _raise_signal(signum, None)


def _raise_signal(signum: int, frame: Any) -> None:
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def _quiet_elastic_logging() -> None:
    level = os.environ.get("TORCHRIG_LOG_LEVEL", "").upper()
    if level in ("DEBUG", "INFO"):
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _rendezvous(plan: LaunchPlan) -> tuple[RendezvousHandler, str | None, int | None]:
    backend = plan.rdzv_backend or "c10d"
    single = plan.num_nodes == 1
    if backend == "local":
        port = int(plan.rdzv_endpoint.rpartition(":")[2] or 0)
        return SingleNodeRendezvous(f"{plan.run_id}-{uuid.uuid4().hex[:8]}", first_port=port), None, None
    endpoint = plan.rdzv_endpoint
    host = endpoint.rpartition(":")[0] or "127.0.0.1"
    master_addr = plan.master_addr or ("127.0.0.1" if single else host)
    configs: dict[str, Any] = dict(plan.rdzv_configs)
    spec_addr = spec_port = None
    if backend == "c10d":
        configs.setdefault("is_host", plan.node_rank == 0)
    elif backend == "static":
        configs.setdefault("rank", plan.node_rank)
        spec_addr, spec_port = host, int(endpoint.rpartition(":")[2])
    params = RendezvousParameters(
        backend=backend, endpoint=endpoint,
        run_id=plan.run_id if not single else f"{plan.run_id}-{uuid.uuid4().hex[:8]}",
        min_nodes=plan.num_nodes, max_nodes=plan.num_nodes,
        local_addr="127.0.0.1" if single else (master_addr if plan.node_rank == 0 else None), **configs,
    )
    handler = rdzv_registry.get_rendezvous_handler(params)
    if backend == "c10d":
        handler = MachineRankRendezvous(handler, plan.node_rank, master_addr)
    return handler, spec_addr, spec_port


def launch_with_elastic(plan: LaunchPlan) -> int:
    """Run ``plan.nproc_per_node`` workers of ``plan.command`` on this node; returns the exit
    code: 0, 1 (a worker failed, or the launch did), or 128 + a signal the launcher received."""
    if not plan.command:
        raise ValueError("LaunchPlan.command is empty: nothing to launch")
    log_dir = plan.log_dir or tempfile.mkdtemp(prefix="torchrig-launch-")  # removed again on success
    os.makedirs(log_dir, exist_ok=True)
    # Workers inherit the launcher's environment; this process exists to launch them.
    os.environ.update(plan.env)
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # fresh master port per attempt
    _quiet_elastic_logging()
    started_at = time.time()
    observer = Observer(plan, log_dir)
    launcher_signal: str | None = None
    launch_error: str | None = None
    previous = {s: signal.signal(s, _raise_signal) for s in _HANDLED_SIGNALS}  # until elastic installs its own
    previous[FORWARDED_SIGNAL] = signal.signal(FORWARDED_SIGNAL, lambda signum, frame: observer.forward(signum))
    handler = None
    shutdown_rdzv = True
    result: RunResult | None = None
    try:
        _pass_on_held_signals(observer)  # arrived while the launcher was starting
        handler, spec_addr, spec_port = _rendezvous(plan)
        entrypoint, *args = plan.command
        spec = WorkerSpec(
            role="worker", local_world_size=plan.nproc_per_node, entrypoint=entrypoint, args=tuple(args),
            rdzv_handler=handler, max_restarts=plan.max_restarts, monitor_interval=plan.monitor_interval,
            master_addr=spec_addr, master_port=spec_port,
        )
        agent = TorchrigAgent(
            spec=spec, logs_specs=TorchrigLogsSpecs(log_dir, plan.tee), start_method="spawn",
            observer=observer, grace=plan.shutdown_grace_s,
        )
        result = agent.run()
        if result is None:
            launch_error = "the rendezvous was closed before the workers started"
    except SignalException as exc:
        shutdown_rdzv = False
        launcher_signal = signal.Signals(exc.sigval).name
        observer.teardown(exc.sigval)
    except KeyboardInterrupt:
        shutdown_rdzv = False
        launcher_signal = "SIGINT"
    except Exception as exc:
        launch_error = f"{type(exc).__name__}: {exc}"
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)
        if handler is not None and shutdown_rdzv:
            try:
                handler.shutdown()
            except Exception:
                pass
    failures = result.failures if result is not None else None
    observer.end(failures, launcher_signal=launcher_signal)
    code = _finish(plan, log_dir, observer, started_at, launcher_signal=launcher_signal, launch_error=launch_error)
    if code == 0 and plan.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    return code


def _finish(plan: LaunchPlan, log_dir: str, observer: Observer, started_at: float, *,
            launcher_signal: str | None, launch_error: str | None) -> int:
    attempts = observer.attempts
    last = attempts[-1] if attempts else {"ranks": [], "verdict": _summary.analyze(
        [], launcher_signal=launcher_signal, launch_error=launch_error or "no worker was started")}
    verdict = last["verdict"]
    if launch_error and attempts:
        verdict = _summary.analyze(last["ranks"], launcher_signal=launcher_signal, launch_error=launch_error)
        last["verdict"] = verdict
    if verdict["state"] == _status.PREEMPTED and not launch_error:
        # also when the launcher's own SIGTERM was the warning: the ranks answered it with a checkpoint
        code, state = int(last["ranks"][0].get("exit_code") or 0), _status.PREEMPTED
    elif launcher_signal:
        code = 128 + int(signal.Signals[launcher_signal])
        state = _status.INTERRUPTED if launcher_signal == "SIGINT" else _status.TERMINATED
    elif verdict["state"] == _status.FINISHED and not launch_error:
        code, state = 0, _status.FINISHED
    else:
        code, state = 1, _status.FAILED
    plan_info = {"nproc_per_node": plan.nproc_per_node, "num_nodes": plan.num_nodes, "node_rank": plan.node_rank,
                 "rdzv_backend": plan.rdzv_backend, "rdzv_endpoint": plan.rdzv_endpoint, "max_restarts": plan.max_restarts,
                 "command": list(plan.command), "log_dir": log_dir}
    report = _summary.run_status(run_id=os.path.basename(os.path.normpath(log_dir)), state=state, exit_code=code,
                                 attempts=attempts or [last], plan=plan_info, warnings=list(plan.warnings),
                                 started_at=started_at)
    _status.write_json_atomic(os.path.join(log_dir, _status.RUN_STATUS_FILE), report)
    if state != _status.FINISHED or report["restarts_used"] or report["warnings"]:
        text = _summary.format_summary(verdict, last["ranks"], log_dir=log_dir, restarts_used=report["restarts_used"],
                                       max_restarts=plan.max_restarts, warnings=report["warnings"])
        print(text, file=sys.stderr, flush=True)
    return code


__all__ = ["LOG_LINE_PREFIX", "MachineRankRendezvous", "TorchrigAgent", "TorchrigLogsSpecs", "free_port",
           "launch_with_elastic"]
