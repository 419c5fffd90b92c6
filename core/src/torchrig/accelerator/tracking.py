"""The Accelerator's experiment tracking and throughput monitor: ``init_trackers``, ``log``,
``get_tracker`` over the run's :class:`~torchrig.tracking.hub.TrackerHub` (docs/trackers.md), and
``accelerator.throughput``, which logs through them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchrig.config.options import ThroughputMonitorConfig
from torchrig.host.run import RunContext
from torchrig.plugin.types import PreparedModel
from torchrig.tracking.hub import TrackerHub
from torchrig.tracking.throughput import ThroughputMonitor, device_peak_flops, estimate_flops_per_token


class TrackingCalls:
    """Trackers and the throughput monitor of an :class:`~torchrig.Accelerator`."""

    _run: RunContext
    _trackers: TrackerHub
    _throughput: ThroughputMonitor
    _models: list[PreparedModel]
    gradient_state: Any
    device: Any
    mixed_precision: str
    num_processes: int
    is_main_process: bool
    logging_dir: str | None

    def init_trackers(self, project_name: str, config: Mapping[str, Any] | None = None,
                      init_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Start one run per tracker of ``log_with`` — on the main process only — and record
        ``config`` plus the resolved torchrig configuration (with sources) once. ``init_kwargs``:
        ``{tracker name: arguments}`` (e.g. ``{"wandb": {"entity": "me"}}``). Call on every rank."""
        self._trackers.init(project_name, config, init_kwargs, logging_dir=self.logging_dir)

    def log(self, values: Mapping[str, Any], step: int | None = None,
            log_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        """Send ``values`` at ``step`` (None: the step after the last one) to every tracker;
        returns at once — trackers run on background threads and never stop training."""
        self._trackers.log(values, step, log_kwargs)

    def get_tracker(self, name: str, unwrap: bool = False) -> Any:
        """The tracker ``name`` (calls through it are queued like ``log``), or with ``unwrap`` the
        library's own object (W&B run, SummaryWriter...). On ranks where it does not run: a
        stand-in whose calls do nothing."""
        return self._trackers.get(name, unwrap)

    @property
    def trackers(self) -> list[Any]:
        """The trackers running on this process (none on ranks other than the main one)."""
        return self._trackers.handles

    def _arm_throughput(self) -> ThroughputMonitor:
        """The monitor behind ``accelerator.throughput``; it measures only on the main process and
        only when ``throughput_monitor.enabled`` (then :meth:`_step_plan` wraps ``optimizer_step``)."""
        options = self._run.section(ThroughputMonitorConfig)
        peak = options.peak_flops_per_device
        if peak is None and options.enabled:
            peak = device_peak_flops(self.device, self.mixed_precision)
        state = self.gradient_state

        def samples_per_step() -> int | None:
            loader = state.active_dataloaders[-1] if state.active_dataloaders else None
            size = getattr(loader, "total_batch_size", None)
            return None if size is None else size * state.num_steps

        def flops_per_token() -> float | None:
            seq = options.tokens_per_sample
            return None if seq is None or not self._models else estimate_flops_per_token(self._models[0].unwrapped, seq)

        return ThroughputMonitor(options, world_size=self.num_processes, device=self.device,
                                 active=options.enabled and self.is_main_process, log=self.log,
                                 samples_per_step=samples_per_step, flops_per_token=flops_per_token,
                                 peak_flops_per_device=peak)

    @property
    def throughput(self) -> ThroughputMonitor:
        """The throughput monitor (``throughput_monitor`` config): ``latest`` values, ``progress()``,
        ``update(samples=..., tokens=...)``; docs/trackers.md, "Throughput and MFU"."""
        return self._throughput


__all__ = ["TrackingCalls"]
