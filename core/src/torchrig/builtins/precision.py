"""Built-in precision plugins: ``no`` (fp32), ``bf16`` (autocast) and ``fp16`` (autocast with a
dynamic GradScaler). They install plain callables into the step plan once, at prepare; nothing
here runs through pluggy per step.
"""

from __future__ import annotations

from typing import Any

import torch

from torchrig.host.run import RunContext
from torchrig.plugin.markers import hookimpl
from torchrig.training.step_plan import StepPlanBuilder, grad_scaler_kwargs, install_autocast, install_loss_scaling


class PrecisionPlugin:
    """Shared behaviour: check the device supports the mode; install autocast."""

    name = "no"
    dtype: torch.dtype | None = None

    @hookimpl
    def torchrig_configure(self, run: RunContext) -> None:
        if run.device is None:
            return
        problem = run.device.precision_problem(self.name)
        if problem:
            raise RuntimeError(f"mixed_precision={self.name!r} cannot run on {run.device.device}: {problem}")

    @hookimpl
    def torchrig_precision_step_plan(self, run: RunContext, plan: StepPlanBuilder) -> None:
        if self.dtype is not None:
            install_autocast(run, plan, self.dtype)


class FullPrecision(PrecisionPlugin):
    name = "no"
    dtype = None


class BFloat16Precision(PrecisionPlugin):
    name = "bf16"
    dtype = torch.bfloat16


class Float16Precision(PrecisionPlugin):
    """fp16 autocast; the loss is scaled in ``backward`` and the step goes through the scaler,
    which skips steps whose gradients overflowed (reported by ``optimizer_step``'s result)."""

    name = "fp16"
    dtype = torch.float16

    def __init__(self) -> None:
        self.scaler: torch.amp.GradScaler | None = None

    @hookimpl
    def torchrig_checkpoint_state(self, run: RunContext) -> dict[str, Any]:
        """The loss scale and its growth tracker resume with the run (Accelerate's ``scaler.pt``)."""
        return {"scaler": self.scaler} if self.scaler is not None else {}

    @hookimpl
    def torchrig_precision_step_plan(self, run: RunContext, plan: StepPlanBuilder) -> None:
        super().torchrig_precision_step_plan(run, plan)
        assert run.device is not None
        self.scaler = torch.amp.GradScaler(run.device.autocast_device_type, **grad_scaler_kwargs(run))
        install_loss_scaling(plan, self.scaler)
