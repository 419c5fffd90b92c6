"""The Accelerator's preemption handling (``preemption.signals``, docs/preemption.md): arming the
signal handlers and the step boundary the data layer calls, and the coordinated stop — every
rank commits a checkpoint at the same step, the job is requeued where a cluster plugin can,
and the run exits with the configured code."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from torchrig.config.options import PreemptionConfig
from torchrig.config.resolve import ResolvedConfig
from torchrig.errors import ConfigError
from torchrig.host.run import RunContext
from torchrig.resilience import run_status
from torchrig.resilience.preemption import Preempted, install_signal_handlers, keep_only, run_requeue_command
from torchrig.resilience.preemption_watch import PreemptionWatch


class PreemptionCalls:
    """Preemption of an :class:`~torchrig.Accelerator`."""

    _run: RunContext
    _host: Any
    _preemption: PreemptionWatch | None
    _requeue_command: list[str]
    config: ResolvedConfig
    gradient_state: Any
    num_processes: int
    is_main_process: bool

    if TYPE_CHECKING:  # the Accelerator's own (declared here for type checkers only: no stub may shadow them)
        def save_state(self, output_dir: Any = None, safe_serialization: bool = True, **kwargs: Any) -> str: ...

        def wait_for_everyone(self) -> None: ...

        def end_training(self) -> dict[str, dict[str, Any]]: ...

        def print(self, *args: Any, **kwargs: Any) -> None: ...

    def _arm_preemption(self) -> PreemptionWatch | None:
        """With ``preemption.signals`` set: record those signals, refuse what could not be honoured
        (nowhere to save, a requeue nobody can do), and hand the step boundary to the data layer."""
        options = self._run.section(PreemptionConfig)
        keep_only(options.signals)  # installed early from the environment; the resolved configuration decides
        if not options.signals:
            return None
        problems = []
        project = self.config.section("project_config")
        if not (project.project_dir and project.automatic_checkpoint_naming):
            problems.append(f"preemption.signals ({self.config.source('preemption.signals')}): a preemption "
                            "checkpoint needs automatically named checkpoints to resume from: set "
                            "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True) (config keys "
                            "project_config.project_dir and project_config.automatic_checkpoint_naming)")
        self._requeue_command: list[str] = []
        if options.requeue:
            self._requeue_command = list(self._host.hook.torchrig_requeue_command(environ=dict(os.environ)) or [])
            if not self._requeue_command:
                problems.append(f"preemption.requeue ({self.config.source('preemption.requeue')}): no cluster plugin "
                                "can requeue this job (it does not run under a scheduler torchrig knows, e.g. Slurm); "
                                "set preemption.requeue to false and resubmit the job yourself")
        if problems:
            raise ConfigError(problems)
        install_signal_handlers(options.signals)
        watch = PreemptionWatch(self.num_processes, self._stop_for_preemption)
        self.gradient_state.step_boundary = watch.at_step_boundary
        return watch

    def _stop_for_preemption(self, signal_name: str) -> None:
        """Every rank, at the same step boundary: commit a checkpoint, end the run, requeue, exit."""
        assert self._preemption is not None
        options = self._run.section(PreemptionConfig)
        checkpoint = self.save_state(async_save=False)
        step = self._preemption.steps
        requeued = None
        if self._requeue_command and self.is_main_process:
            requeued, failure = run_requeue_command(self._requeue_command)
            if failure:  # the checkpoint is safe; say why the job will not come back by itself
                self.print(f"torchrig: preemption: {failure}", file=sys.stderr)
        if self._requeue_command:
            self.wait_for_everyone()  # no rank exits (srun --kill-on-bad-exit) before the job is requeued
        run_status.record(preempted={"signal": signal_name, "checkpoint": checkpoint, "step": step, "requeued": requeued})
        self.end_training()
        stop = Preempted(options.exit_code, signal_name=signal_name, checkpoint=checkpoint, step=step, requeued=requeued)
        self.print(f"torchrig: {stop}", file=sys.stderr, flush=True)
        raise stop
