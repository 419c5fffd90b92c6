"""Handing ``torchrig launch`` over to a cluster's own launcher (``srun``, ``sbatch``, ``mpirun``):
running it in the foreground, forwarding signals, refusing a value that cannot reach it, and
recording the outcome in ``run_status.json``.

What any cluster plugin's ``torchrig_launch`` needs once it decided to hand off; which launcher and
which command line is the plugin's own (the built-in ones: :mod:`torchrig.builtins.clusters.slurm`,
:mod:`torchrig.builtins.clusters.mpi`, which sit above this layer and call it). Torch-free.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from torchrig.launch.status import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    PREEMPTED,
    RUN_STATUS_FILE,
    TERMINATED,
    write_json_atomic,
)
from torchrig.launch.summary import run_status
from torchrig.plugin.types import LaunchPlan

PROG = "torchrig launch"


class HandoffRefused(ValueError):
    """A value that cannot reach the cluster's launcher safely; the message names it and what to do."""


#: ``torchrig launch``'s exit code for a value refused before anything was handed off (a usage error).
EXIT_REFUSED = 2


def refuse(plan: LaunchPlan, what: str, exc: HandoffRefused) -> int:
    """A value that cannot reach ``what`` safely: say so (no traceback), record it, start nothing."""
    print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
    record_handoff(plan, [], what, state=FAILED, exit_code=EXIT_REFUSED, reason="refused",
                   headline=f"nothing was handed to {what}: {exc}")
    return EXIT_REFUSED



#: Signals passed on to the cluster's launcher, which passes them to the ranks (``srun`` and
#: ``mpirun`` both forward SIGINT, SIGTERM, SIGUSR1 to their tasks).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


def run_forwarding(plan: LaunchPlan, command: Sequence[str], *, what: str) -> int:
    """Run the cluster's launcher in the foreground, forwarding stop and preemption signals;
    record its exit in ``run_status.json``; return its exit code."""
    print(f"{PROG}: handing off to {what}: {shlex.join(command)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(list(command), env={**os.environ, **plan.env})
    previous = {}

    def forward(signum: int, frame: Any) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    for signum in FORWARDED_SIGNALS:
        previous[signum] = signal.signal(signum, forward)
    try:
        code = proc.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    preempted = plan.config.get("preemption.exit_code") if plan.config is not None else None
    state = {0: FINISHED, 130: INTERRUPTED, 143: TERMINATED, preempted: PREEMPTED}.get(code, FAILED)
    record_handoff(plan, command, what, state=state, exit_code=code,
                   headline=f"{what} exited with code {code}; the ranks' output is {what}'s")
    return code


def record_handoff(plan: LaunchPlan, command: Sequence[str], what: str, *, state: str, exit_code: int,
                   headline: str, reason: str | None = None, detail: dict[str, Any] | None = None) -> None:
    """``run_status.json`` of a launch handed to a cluster's launcher: there are no per-rank status
    files (the ranks run the user's command, not torchrig's wrapper), so only the outcome."""
    if not plan.log_dir:
        return
    os.makedirs(plan.log_dir, exist_ok=True)
    report = run_status(run_id=os.path.basename(os.path.normpath(plan.log_dir)), state=state, exit_code=exit_code,
                        attempts=[], plan={"max_restarts": 0, "handed_off_to": what, "command": list(command)},
                        warnings=list(plan.warnings))
    report["headline"] = headline
    report["reason"] = reason or report.get("reason")
    if detail is not None:  # what the cluster's launcher itself said (sbatch's exit code and stderr)
        report["handoff"] = {"command": list(command), **detail}
    write_json_atomic(os.path.join(plan.log_dir, RUN_STATUS_FILE), report)


__all__ = ["EXIT_REFUSED", "FORWARDED_SIGNALS", "PROG", "HandoffRefused", "record_handoff", "refuse", "run_forwarding"]
