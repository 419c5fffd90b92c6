"""Local SGD (Accelerate's ``accelerate.local_sgd.LocalSGD``): ranks step independently, averaging
their parameters every ``local_sgd_steps`` steps instead of all-reducing gradients every step.

Averaging parameters in place only makes sense when every rank holds every parameter in full, so
the context refuses strategies whose declared capabilities say otherwise
(:attr:`torchrig.plugin.types.Capabilities.replicated_parameters` is False: FSDP, DeepSpeed ZeRO), whatever
their name. Between averages the model runs inside ``accelerator.no_sync``: no gradient communication.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self

from torchrig.compat.resolve import module_attributes


class LocalSGD:
    """``with LocalSGD(accelerator=..., model=..., local_sgd_steps=K) as local_sgd:`` ... ``local_sgd.step()``.

    On one process (or with ``enabled=False``) it does nothing but count steps, as in Accelerate.
    Parameters are averaged after every ``K``-th :meth:`step` and once more when the block exits.
    """

    def __init__(self, accelerator: Any, model: Any, local_sgd_steps: int, enabled: bool = True):
        if not accelerator.strategy_capabilities.replicated_parameters:
            raise NotImplementedError(
                f"LocalSGD averages whole parameters in place, but the selected strategy "
                f"{accelerator.strategy!r} does not declare replicated parameters (it shards or owns them, as "
                f"FSDP and DeepSpeed do). Use the ddp strategy, or pass enabled=False.")
        if int(local_sgd_steps) < 1:
            raise ValueError(f"LocalSGD: local_sgd_steps must be a positive number of steps, got {local_sgd_steps}.")
        self.enabled = bool(enabled) and accelerator.num_processes > 1
        self.num_steps = 0
        #: How many parameter averages (one all-reduce per parameter each) this context performed.
        self.num_syncs = 0
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = int(local_sgd_steps)
        self._no_sync: Any = None

    def __enter__(self) -> Self:
        if self.enabled:
            self._no_sync = self.accelerator.no_sync(self.model)
            self._no_sync.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if not self.enabled:
            return
        try:
            if exc_type is None:  # after a failure the other ranks may never reach this collective
                self._sync_and_avg_model_params()
        finally:
            self._no_sync.__exit__(exc_type, exc, tb)

    def step(self) -> None:
        """Count one optimizer step; average the parameters on every ``local_sgd_steps``-th."""
        self.num_steps += 1
        if self.enabled and self.num_steps % self.local_sgd_steps == 0:
            self._sync_and_avg_model_params()

    def _sync_and_avg_model_params(self) -> None:
        self.accelerator.wait_for_everyone()
        with self.accelerator.autocast():
            for param in self.model.parameters():
                param.data = self.accelerator.reduce(param.data, reduction="mean")
        self.num_syncs += 1


__all__ = ["LocalSGD"]

# Accelerate's other names at this path (Accelerator, DistributedType): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
