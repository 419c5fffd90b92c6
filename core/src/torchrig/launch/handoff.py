"""Handing ``torchrig launch`` over to Slurm or MPI: running their launcher, forwarding signals,
recording the outcome in ``run_status.json`` — and the plugin classes that do it.

The slurm and mpi cluster plugins' runtime objects are :class:`SlurmLauncher` and
:class:`MPILauncher`: the detection of :class:`~torchrig.builtins.clusters.SlurmCluster` /
:class:`~torchrig.builtins.clusters.MPICluster` (which every rank uses) plus the launcher's
hooks, which live here, in the launch layer, because they run the cluster's launcher and write
the launcher's status file. The command lines themselves are :mod:`torchrig.builtins.handoff`.
Torch-free.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from torchrig.builtins.clusters import MPICluster, SlurmCluster, mpi_hands_off, slurm_launch_mode
from torchrig.builtins.handoff import (
    PROG,
    SUBMITTED,
    HandoffRefused,
    allocation_srun,
    describe_mpi,
    describe_slurm,
    mpirun_line,
    output_file,
    sbatch_output,
    sbatch_script,
)
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
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import LaunchPlan


class SlurmLauncher(SlurmCluster):
    """The slurm plugin: detection (inherited) and the hand-off to ``srun`` / ``sbatch``."""

    @hookimpl
    def torchrig_launch(self, plan: LaunchPlan) -> int | None:
        """Hand off to Slurm where :func:`slurm_launch_mode` says so; else torch elastic starts the workers."""
        mode = slurm_launch_mode(plan, os.environ)
        if mode is None:
            return None
        try:
            if mode == "srun":
                return run_forwarding(plan, allocation_srun(plan, os.environ), what="srun")
            return submit(plan)
        except HandoffRefused as exc:
            return refuse(plan, "srun" if mode == "srun" else "sbatch", exc)

    @hookimpl
    def torchrig_describe_launch(self, plan: LaunchPlan) -> str | None:
        mode = slurm_launch_mode(plan, os.environ)
        if mode is None:
            return None
        return describe_slurm(plan, allocation_srun(plan, os.environ) if mode == "srun" else None)


class MPILauncher(MPICluster):
    """The mpi plugin: detection (inherited) and the hand-off to ``mpirun``."""

    @hookimpl
    def torchrig_launch(self, plan: LaunchPlan) -> int | None:
        """With ``cluster: mpi`` (and not already an MPI rank): every rank started by ``mpirun``."""
        if not mpi_hands_off(plan, os.environ):
            return None
        try:
            return run_mpirun(plan)
        except HandoffRefused as exc:
            return refuse(plan, "mpirun", exc)

    @hookimpl
    def torchrig_describe_launch(self, plan: LaunchPlan) -> str | None:
        return describe_mpi(plan) if mpi_hands_off(plan, os.environ) else None


#: ``torchrig launch``'s exit code for a value refused before anything was handed off (a usage error).
EXIT_REFUSED = 2


def refuse(plan: LaunchPlan, what: str, exc: HandoffRefused) -> int:
    """A value that cannot reach ``what`` safely: say so (no traceback), record it, start nothing."""
    print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
    record_handoff(plan, [], what, state=FAILED, exit_code=EXIT_REFUSED, reason="refused",
                   headline=f"nothing was handed to {what}: {exc}")
    return EXIT_REFUSED


#: How long ``sbatch`` may take to answer (it only talks to slurmctld).
SBATCH_TIMEOUT_S = 120


def submit(plan: LaunchPlan) -> int:
    """Write the batch script into the log directory and ``sbatch`` it; print the job id and how to
    follow it. When sbatch fails (a bad partition, a rejected job), its exit code and stderr are the
    diagnosis: printed and recorded in ``run_status.json``."""
    script = sbatch_script(plan)
    log_dir = plan.log_dir or os.getcwd()
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, "sbatch.sh")
    with open(path, "w") as handle:
        handle.write(script)
    sbatch = shutil.which("sbatch")
    command = [sbatch or "sbatch", "--parsable", path]
    if sbatch is None:
        return sbatch_failed(plan, command, None, f"sbatch is not on PATH: run `{PROG} --cluster slurm` where "
                             f"Slurm's commands are (a login node), or submit the script it wrote yourself: "
                             f"sbatch {shlex.quote(path)}")
    try:
        proc = subprocess.run(command, env={**os.environ, **plan.env}, capture_output=True, text=True,
                              timeout=SBATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return sbatch_failed(plan, command, None, f"sbatch did not answer in {SBATCH_TIMEOUT_S} s (is slurmctld "
                             f"reachable? `scontrol ping`); the job may or may not have been submitted: check "
                             "`squeue --me`")
    if proc.returncode != 0:
        said = (proc.stderr or proc.stdout).strip() or "(no output)"
        return sbatch_failed(plan, command, proc.returncode,
                             f"sbatch rejected the job (exit {proc.returncode}): {said}", stderr=said)
    job = proc.stdout.strip().split(";")[0]
    record_handoff(plan, command, "sbatch", state=SUBMITTED, exit_code=0, headline=f"submitted Slurm job {job}")
    output = sbatch_output(plan)
    print(f"{PROG}: submitted Slurm job {job} (script {path})", flush=True)
    print(f"{PROG}: follow it with `squeue -j {job}` and `tail -f {shlex.quote(output_file(output, job))}`; "
          f"cancel it with `scancel {job}`", flush=True)
    return 0


def sbatch_failed(plan: LaunchPlan, command: Sequence[str], exit_code: int | None, message: str, *,
                  stderr: str | None = None) -> int:
    """Nothing was submitted: the reason printed and recorded (``reason: "sbatch_failed"``, sbatch's
    exit code and stderr in ``handoff``); ``torchrig launch`` exits 1."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
    record_handoff(plan, command, "sbatch", state=FAILED, exit_code=1, reason="sbatch_failed", headline=message,
                   detail={"exit_code": exit_code, "stderr": stderr})
    return 1


def run_mpirun(plan: LaunchPlan) -> int:
    command = mpirun_line(plan)
    if shutil.which(command[0]) is None:
        raise FileNotFoundError("mpirun is not on PATH: install Open MPI (Debian: openmpi-bin) or drop "
                                "`--cluster mpi` to start the workers with torch elastic")
    return run_forwarding(plan, command, what="mpirun")


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


__all__ = ["EXIT_REFUSED", "FORWARDED_SIGNALS", "SBATCH_TIMEOUT_S", "MPILauncher", "SlurmLauncher", "record_handoff",
           "refuse", "run_forwarding", "run_mpirun", "sbatch_failed", "submit"]
