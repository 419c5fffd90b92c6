"""The core's default launch: torch.distributed.elastic, the engine torchrun uses.

``torchrig launch`` builds a :class:`~torchrig.plugin.types.LaunchPlan`; this module runs the workers of
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
* **Rollbacks.** Ranks that stopped for the training guard's rollback (each records it in its
  status file before any exits) are restarted from the last checkpoint on top of
  ``--max_restarts``: the guard's ``max_rollbacks`` bounds them (:mod:`torchrig.resilience.training_guard`).
* **Quiet.** Elastic's own log lines (``Sending process ... closing signal``) are hidden unless
  ``TORCHRIG_LOG_LEVEL`` is DEBUG or INFO; the summary says what happened.

The agent and its launch live here; the rendezvous handlers in :mod:`torchrig.launch.rendezvous`,
the bookkeeping of each attempt (pids, exit times, rank records) in :mod:`torchrig.launch.observer`.

Imports torch: only called from the ``torchrig_launch`` hook.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import string
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import SignalException, Std
from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from torchrig.launch import held_signals
from torchrig.launch import status as _status
from torchrig.launch import summary as _summary
from torchrig.launch.observer import Observer
from torchrig.launch.rendezvous import MachineRankRendezvous, rendezvous_handler
from torchrig.launch.tail import LogRelay
from torchrig.plugin.types import LaunchPlan

#: Console prefix of each worker's output lines (a ``string.Template`` of ``rank``).
LOG_LINE_PREFIX = "[rank${rank}]: "
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: Passed on to every rank, nothing torn down: a scheduler's warning (Slurm ``--signal=USR1@T``)
#: that the ranks turn into a preemption checkpoint (:mod:`torchrig.resilience.preemption`).
FORWARDED_SIGNAL = signal.SIGUSR1


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
            elif attempt and result.state is not WorkerState.SUCCEEDED and _rollback_of(attempt):
                # The training guard's rollback: restart from the last checkpoint. Bounded by the guard's
                # max_rollbacks (its ledger), so it is granted on top of --max_restarts, never taken from it.
                worker_group.spec.max_restarts += 1
                self._remaining_restarts += 1
                print(f"torchrig launch: attempt {attempt['attempt']} rolled back: {_rollback_of(attempt)}; "
                      "restarting from the last checkpoint (training_guard rollback: not counted against "
                      "--max_restarts)", file=sys.stderr, flush=True)
            elif attempt and result.state is not WorkerState.SUCCEEDED and self._remaining_restarts > 0:
                print(f"torchrig launch: attempt {attempt['attempt']} failed: {attempt['verdict']['headline']}; "
                      f"restarting ({worker_group.spec.max_restarts - self._remaining_restarts + 1} of "
                      f"{worker_group.spec.max_restarts})", file=sys.stderr, flush=True)
        return result


def _rollback_of(attempt: Mapping[str, Any]) -> str | None:
    """What the training guard's rollback recorded in a rank's status (the ranks record it before any
    exits), or None when no rank of the attempt rolled back."""
    rollback = next((rank["rollback"] for rank in attempt["ranks"] if rank.get("rollback")), None)
    if rollback is None:
        return None
    batches = ", ".join(f"dataloader {b['dataloader']} epoch {b['epoch']} batch {b['batch']}"
                        for b in rollback.get("batches", ()))
    return f"bad step {rollback.get('step')} on {batches or 'no batch'}, back to {rollback.get('checkpoint')}"


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
        handler, spec_addr, spec_port = rendezvous_handler(plan)
        if isinstance(handler, MachineRankRendezvous) and handler.elastic:
            handler.grow_at_commit(observer.last_commit)  # a joining machine waits for the next checkpoint
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


__all__ = ["LOG_LINE_PREFIX", "TorchrigAgent", "TorchrigLogsSpecs", "launch_with_elastic"]
