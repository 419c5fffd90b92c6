"""Preemption: a signal asks for a final checkpoint; the job then stops so its scheduler can requeue it.

Schedulers warn a job before they end it: Slurm sends ``--signal=USR1@<seconds>`` before the time
limit and SIGTERM before a preemption kill; Kubernetes sends SIGTERM and waits the pod's grace
period. With ``preemption.signals`` set, torchrig turns that warning into a committed checkpoint:

* **The handler only records.** Acting inside a signal handler would interrupt whatever the
  main thread was doing — a collective, a half-written checkpoint file. The handler notes the
  signal; :mod:`torchrig.launch.worker` installs it before the script starts, so a warning that
  arrives during imports is not lost (SIGUSR1's default action would end the process). Without
  the launcher (``python train.py``, ``srun``, ``torchrun``) ``import torchrig`` installs it when
  ``TORCHRIG_PREEMPTION__SIGNALS`` is set (:func:`install_from_environment`), so a warning that
  arrives before the ``Accelerator`` exists is honoured at its first step boundary; the
  Accelerator's resolved configuration has the last word (:func:`keep_only`).
* **Ranks agree on one step.** The signal reaches ranks at different moments (or only some of
  them), and a checkpoint is a collective: every rank must stop after the same optimizer step.
  At each step boundary — a prepared DataLoader about to read the next batch after a
  synchronising optimizer step — each rank contributes its flag to an ``all_reduce(MAX)`` on a
  gloo group of its own, started asynchronously and read at the next boundary, so the hot path
  never waits for it: ranks stop at most one step after the first one saw the signal, all at
  the same step. With one process there is nothing to agree on: it stops at the next boundary.
* **The stop** saves through the normal commit protocol (``save_state``; automatic naming, so
  ``load_state()`` finds it), ends the trackers, asks the cluster plugins for the command that
  requeues the job when ``preemption.requeue`` is set (``torchrig_requeue_command``: Slurm's
  ``scontrol requeue``), and raises :class:`Preempted` — a ``SystemExit`` with
  ``preemption.exit_code`` (75, ``EX_TEMPFAIL``: "try again"), recorded as ``preempted`` by
  the launcher, which neither restarts nor calls it a failure.

Torch-free at import: the worker wrapper imports this before the user's script.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterable
from typing import Any

#: Exit code of a preempted rank unless ``preemption.exit_code`` says otherwise (sysexits' EX_TEMPFAIL).
PREEMPTED_EXIT_CODE = 75

_lock = threading.Lock()
_requested: tuple[str, float] | None = None  # (signal name, time) of the first request
_installed: dict[int, Any] = {}  # signal number -> the handler it replaced


def _record(signum: int, frame: Any) -> None:
    global _requested
    if _requested is None:
        _requested = (signal.Signals(signum).name, time.time())


def install_signal_handlers(names: Iterable[str]) -> list[str]:
    """Record ``names`` (``SIGUSR1``, ``SIGTERM``) as preemption requests from now on; returns
    the names installed. Main thread only (Python's rule for signal handlers); idempotent."""
    installed = []
    with _lock:
        for name in names:
            signum = int(signal.Signals[name])
            if signal.getsignal(signum) is not _record:  # also when a handler set since replaced ours
                _installed[signum] = signal.signal(signum, _record)
            installed.append(name)
    return installed


#: The variable of ``preemption.signals``, read at ``import torchrig`` (before any configuration is resolved).
SIGNALS_ENV = "TORCHRIG_PREEMPTION__SIGNALS"
#: The signals ``preemption.signals`` accepts (torchrig.config.options validates the same list).
_ACCEPTED = ("SIGUSR1", "SIGTERM")


def install_from_environment(environ: Any = None) -> list[str]:
    """Record the signals :data:`SIGNALS_ENV` names from now on (``"usr1,term"``, ``"SIGUSR1"``; names
    the configuration would refuse are left to it, which says so). Main thread only; else nothing."""
    text = str((os.environ if environ is None else environ).get(SIGNALS_ENV, ""))
    names = []
    for part in text.replace(",", " ").replace("[", " ").replace("]", " ").replace('"', " ").replace("'", " ").split():
        name = part.strip().upper()
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name in _ACCEPTED and name not in names:
            names.append(name)
    if not names or threading.current_thread() is not threading.main_thread():
        return []
    return install_signal_handlers(names)


def keep_only(names: Iterable[str]) -> None:
    """Stop recording the installed signals that ``names`` (the resolved ``preemption.signals``)
    leaves out: their handlers from before come back, and a request one of them made is raised
    again, so it does what it would have done (SIGUSR1, SIGTERM: end the process) — never swallowed."""
    global _requested
    keep = {int(signal.Signals[name]) for name in names}
    again = None
    with _lock:
        for signum in [s for s in _installed if s not in keep]:
            previous = _installed.pop(signum)
            try:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, TypeError):
                pass
            if _requested is not None and _requested[0] == signal.Signals(signum).name:
                _requested, again = None, signum
    if again is not None:
        signal.raise_signal(again)


def installed_signals() -> list[str]:
    """The signals currently recorded as preemption requests."""
    return [signal.Signals(signum).name for signum in sorted(_installed)]


def request(name: str = "SIGUSR1") -> None:
    """Record a preemption request as if ``name`` had arrived (for code that learns of a
    preemption another way, e.g. a cloud's metadata endpoint)."""
    _record(int(signal.Signals[name]), None)


def requested() -> tuple[str, float] | None:
    """``(signal name, time)`` of the first preemption request of this process, or None."""
    return _requested


def reset() -> None:
    """Forget requests and give the replaced handlers back (end of a run, tests)."""
    global _requested
    with _lock:
        for signum, previous in _installed.items():
            try:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            except (ValueError, TypeError):  # not the main thread / a handler set from C
                pass
        _installed.clear()
        _requested = None


def run_requeue_command(command: list[str]) -> tuple[str | None, str | None]:
    """Run the cluster's requeue command: ``(the command run, None)``, or ``(None, why it failed)``."""
    shown = " ".join(command)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"`{shown}` could not run ({exc}); resubmit the job to resume"
    if result.returncode != 0:
        return None, f"`{shown}` failed ({result.returncode}): {result.stderr.strip()}; resubmit the job to resume"
    return shown, None


class Preempted(SystemExit):
    """Raised in every rank after the preemption checkpoint committed: ends the script with
    ``preemption.exit_code``. A ``SystemExit``, so ``except Exception`` in a script does not swallow it."""

    def __init__(self, code: int, *, signal_name: str, checkpoint: str, step: int, requeued: str | None) -> None:
        super().__init__(code)
        self.signal_name, self.checkpoint, self.step, self.requeued = signal_name, checkpoint, step, requeued

    def __str__(self) -> str:
        how = f"; requeued with `{self.requeued}`" if self.requeued else "; run it again to resume"
        return (f"preempted by {self.signal_name}: checkpoint {self.checkpoint} committed after optimizer step "
                f"{self.step}{how}")


__all__ = ["PREEMPTED_EXIT_CODE", "SIGNALS_ENV", "Preempted", "install_from_environment", "install_signal_handlers",
           "installed_signals", "keep_only", "request", "requested", "reset", "run_requeue_command"]
