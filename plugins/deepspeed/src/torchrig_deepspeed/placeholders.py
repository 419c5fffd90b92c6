"""``DummyOptim`` and ``DummyScheduler``: what a script passes to ``prepare`` when the DeepSpeed
config builds the optimizer (its ``optimizer`` block) or the scheduler (its ``scheduler`` block).

Accelerate's classes and parameters. They carry the values that fill the config's ``"auto"``
entries (learning rate, weight decay, warmup and total steps) and the parameter groups; the
deepspeed strategy hands back the optimizer and scheduler DeepSpeed built in their place.

``DummyOptim`` is a ``torch.optim.Optimizer`` (with no step of its own) so that ``prepare`` pairs it
with its model by parameters like any optimizer; ``DummyScheduler`` has a scheduler's shape for the
same reason. Stepping either outside the deepspeed strategy raises, saying why: nothing would train.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

_OUTSIDE = ("{name} stands for the {what} that the DeepSpeed config builds (its '{block}' block), so it can only be "
            "prepared under the deepspeed strategy (`torchrig launch --use_deepspeed --deepspeed_config_file FILE` or "
            "Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=FILE))); with another strategy use a torch {what}")


class DummyOptim(torch.optim.Optimizer):
    """Placeholder for the optimizer of the DeepSpeed config's ``optimizer`` block.

    ``params`` are the parameters (or parameter groups, each with its own ``weight_decay`` if it
    wants one) DeepSpeed's optimizer will train; ``lr`` and ``weight_decay`` fill the block's
    ``"auto"`` values; ``kwargs`` are kept for scripts that read them back."""

    def __init__(self, params: Iterable[Any], lr: float = 0.001, weight_decay: float = 0, **kwargs: Any) -> None:
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        #: What DeepSpeed receives as ``model_parameters`` (Accelerate's attribute).
        self.params = self.param_groups

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        raise RuntimeError(_OUTSIDE.format(name="DummyOptim", what="optimizer", block="optimizer"))


class DummyScheduler:
    """Placeholder for the scheduler of the DeepSpeed config's ``scheduler`` block, or for the
    scheduler ``lr_scheduler_callable(optimizer)`` builds when the config has none.

    ``warmup_num_steps`` and ``total_num_steps`` fill the block's ``"auto"`` values (the total, as
    in Accelerate, divided by the number of processes unless ``split_batches``: it counts the steps
    of the unsharded dataloader)."""

    def __init__(self, optimizer: Any, total_num_steps: int | None = None, warmup_num_steps: int = 0,
                 lr_scheduler_callable: Callable[[Any], Any] | None = None, **kwargs: Any) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(_OUTSIDE.format(name="DummyScheduler", what="scheduler", block="scheduler"))

    def get_last_lr(self) -> list[float]:
        raise RuntimeError(_OUTSIDE.format(name="DummyScheduler", what="scheduler", block="scheduler"))


class EngineBuiltScheduler:
    """What ``prepare`` hands back for a ``DummyScheduler``: the scheduler DeepSpeed built.

    The engine steps it inside its own step, once per applied optimizer step, so ``step()`` here
    does nothing (as Accelerate's ``DeepSpeedSchedulerWrapper``); everything else is the built
    scheduler's. Its state is saved and restored with the engine's checkpoint too, so loading it
    here as well is harmless."""

    def __init__(self, scheduler: Any, optimizer: Any) -> None:
        self.scheduler = scheduler
        self.optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        """The engine stepped the scheduler already (at its applied optimizer steps)."""

    def get_last_lr(self) -> list[float]:
        getter = getattr(self.scheduler, "get_last_lr", None)
        if getter is not None:
            return list(getter())
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)


__all__ = ["DummyOptim", "DummyScheduler", "EngineBuiltScheduler"]
