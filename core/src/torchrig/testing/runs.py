"""A tiny in-process training run: the quickest end-to-end check of a plugin.

::

    from torchrig.testing import tiny_run

    result = tiny_run(mixed_precision="bf16", steps=3)
    assert result.losses[-1] < result.losses[0]
    result.hooks.assert_order(["torchrig_strategy_capabilities", "torchrig_precision_step_plan",
                               "torchrig_prepare_model"])

One process, on the CPU unless ``cpu=False``, through the real ``Accelerator`` (discovery,
configuration, selection, step plan), with a fixed tiny MLP and fixed data, in an environment
without ``TORCHRIG_*`` variables or a machine default config file. Multi-rank behaviour belongs to
the contract suites on the gloo worker pool.
"""

from __future__ import annotations

from typing import Any

import attrs

from torchrig.testing.contracts._common import flat_params, rank_environment, tiny_batch, tiny_model
from torchrig.testing.recorder import HookRecorder


@attrs.define(eq=False)
class TinyRun:
    """What :func:`tiny_run` did."""

    #: The Accelerator of the run (its plugins stay registered; inspect ``step_plan.owners``...).
    accelerator: Any
    #: The loss of every micro-step, as floats.
    losses: list[float]
    #: Every parameter, flattened, before the first and after the last step.
    params_before: list[float]
    params_after: list[float]
    #: Hook calls from ``prepare`` on (the Accelerator's construction happens before a recorder
    #: can attach to its plugin host).
    hooks: HookRecorder
    #: Which plugin owns each step-plan slot (``{"autocast": "precision:bf16", ...}``).
    owners: dict[str, str]
    #: ``optimizer_step_was_skipped`` after each optimizer step.
    skipped: list[bool]


def tiny_run(*, steps: int = 3, cpu: bool = True, lr: float = 0.1, environ: dict[str, str] | None = None,
             **accelerator_kwargs: Any) -> TinyRun:
    """Train the tiny model for ``steps`` micro-steps with ``Accelerator(cpu=cpu, **accelerator_kwargs)``
    (``strategy=``, ``mixed_precision=``, ``gradient_accumulation_steps=``, ``kwargs_handlers=``...),
    with ``environ`` (e.g. ``{"TORCHRIG_DEVICE": "xpu"}``) set for the duration."""
    # Imported when called: torchrig.testing stays torch-free to import (its package docstring).
    import torch

    from torchrig import Accelerator

    with rank_environment(0, 1, environ):
        accelerator = Accelerator(cpu=cpu, **accelerator_kwargs)
        model = tiny_model()
        before = flat_params(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        losses: list[float] = []
        skipped: list[bool] = []
        with HookRecorder(accelerator._host) as recorder:
            model, optimizer = accelerator.prepare(model, optimizer)
            for step in range(steps):
                x, y = tiny_batch(0, seed=step % 2)
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.cross_entropy(model(x.to(accelerator.device)), y.to(accelerator.device))
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
                losses.append(float(loss.detach()))
                if accelerator.sync_gradients:
                    skipped.append(bool(accelerator.optimizer_step_was_skipped))
        return TinyRun(accelerator=accelerator, losses=losses, params_before=before,
                       params_after=flat_params(accelerator.unwrap_model(model)), hooks=recorder,
                       owners=dict(accelerator.step_plan.owners), skipped=skipped)


class StepCounter:
    """The step a training script has reached, registered with ``accelerator.register_for_checkpointing``
    so that a resumed (restarted, preempted, grown or shrunk) run continues from the step it saved."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


__all__ = ["StepCounter", "TinyRun", "tiny_run"]
