"""The step plan: plain callables the training step runs, decided once at ``prepare``.

Routing every ``backward``/``step``/``zero_grad`` through pluggy would cost ~1.7 µs per hook
call and eat the 25 µs per-step budget, so hooks *decide* and the hot path calls the frozen
:class:`StepPlan`. The core fills every slot with plain PyTorch, then asks (in this order) the
precision plugin (unless the strategy owns precision), the strategy, and finally opt-in
wrappers to replace or wrap slots. Each slot records its owner for ``--dry-run``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import attrs

from torchrig.config.options import GRAD_SCALER_SECTION, AutocastKwargs, GradScalerKwargs
from torchrig.host.run import RunContext

#: Slot name -> what the callable must do. The signatures are part of the contract.
SLOTS: dict[str, str] = {
    "autocast": "() -> context manager around forward (and the loss computation)",
    "backward": "(loss, **kwargs) -> None: compute gradients of loss",
    "unscale_gradients": "(optimizer) -> None: make gradients true-scale before clipping",
    "clip_grad_norm": "(parameters, max_norm, norm_type) -> total norm tensor",
    "clip_grad_value": "(parameters, clip_value) -> None",
    "optimizer_step": "(optimizer) -> bool: step; False when the step was skipped (fp16 overflow)",
    "zero_grad": "(optimizer, set_to_none) -> None",
    "no_sync": "(model) -> context manager that suppresses gradient synchronisation",
}


def _plain_backward(loss: Any, **kwargs: Any) -> None:
    loss.backward(**kwargs)


def _no_unscale(optimizer: Any) -> None:
    return None


def _plain_step(optimizer: Any) -> bool:
    optimizer.step()
    return True


def _plain_zero_grad(optimizer: Any, set_to_none: bool = True) -> None:
    optimizer.zero_grad(set_to_none=set_to_none)


def _no_sync_if_supported(model: Any) -> contextlib.AbstractContextManager[Any]:
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if callable(no_sync) else contextlib.nullcontext()


def _plain_clip_grad_norm(parameters: Any, max_norm: float, norm_type: float = 2.0) -> Any:
    import torch

    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)


def _plain_clip_grad_value(parameters: Any, clip_value: float) -> None:
    import torch

    torch.nn.utils.clip_grad_value_(parameters, clip_value)


def default_slots() -> dict[str, Callable[..., Any]]:
    """Plain PyTorch for every slot: what a hand-written loop does."""
    return {
        "autocast": contextlib.nullcontext,
        "backward": _plain_backward,
        "unscale_gradients": _no_unscale,
        "clip_grad_norm": _plain_clip_grad_norm,
        "clip_grad_value": _plain_clip_grad_value,
        "optimizer_step": _plain_step,
        "zero_grad": _plain_zero_grad,
        "no_sync": _no_sync_if_supported,
    }


@attrs.frozen
class StepPlan:
    """The callables the training step runs. Built by :class:`StepPlanBuilder`."""

    autocast: Callable[[], Any]
    backward: Callable[..., None]
    unscale_gradients: Callable[[Any], None]
    clip_grad_norm: Callable[..., Any]
    clip_grad_value: Callable[..., None]
    optimizer_step: Callable[[Any], bool]
    zero_grad: Callable[..., None]
    no_sync: Callable[[Any], Any]
    #: slot -> owner (``"core"``, ``"precision:fp16"``, ``"strategy:deepspeed"``...).
    owners: dict[str, str] = attrs.field(factory=dict, eq=False)
    #: The GradScaler the steps go through, or None (Accelerate's ``accelerator.scaler``).
    loss_scaler: Any = attrs.field(default=None, eq=False)


class StepPlanBuilder:
    """Mutable plan handed to the step-plan hooks; ``build()`` freezes it."""

    def __init__(self, owner: str = "core") -> None:
        self._slots = default_slots()
        self._owners = {name: owner for name in self._slots}
        #: Set by the plugin manager around each plugin's hook call, so owners are recorded
        #: without each plugin naming itself.
        self.current_owner: str | None = None
        #: The GradScaler the plan steps through (:func:`install_loss_scaling`), if any.
        self.loss_scaler: Any = None

    def get(self, slot: str) -> Callable[..., Any]:
        """The current callable of ``slot`` (to wrap it)."""
        self._check(slot)
        return self._slots[slot]

    def owner(self, slot: str) -> str:
        self._check(slot)
        return self._owners[slot]

    def set(self, slot: str, fn: Callable[..., Any], owner: str | None = None) -> None:
        """Replace ``slot`` with ``fn``; ``owner`` defaults to the plugin being asked."""
        self._check(slot)
        if not callable(fn):
            raise TypeError(f"step plan slot {slot!r} must be callable, got {type(fn).__name__}")
        self._slots[slot] = fn
        self._owners[slot] = owner or self.current_owner or "unknown"

    def build(self) -> StepPlan:
        return StepPlan(**self._slots, owners=dict(self._owners), loss_scaler=self.loss_scaler)

    @staticmethod
    def _check(slot: str) -> None:
        if slot not in SLOTS:
            raise KeyError(f"unknown step plan slot {slot!r}; slots are: {', '.join(SLOTS)}")


def grad_scaler_kwargs(run: RunContext) -> dict[str, Any]:
    """The configured ``GradScalerKwargs``, as keyword arguments of a (sharded) GradScaler (the
    defaults are the class's)."""
    return attrs.asdict(run.section(GradScalerKwargs))


def install_autocast(run: RunContext, plan: StepPlanBuilder, dtype: Any) -> None:
    """Set the plan's ``autocast`` slot to ``torch.autocast`` in ``dtype`` on the run's device, with
    the ``autocast_kwargs`` options: what a mixed-precision plugin installs (bf16, fp16, and fp8's
    bf16 for the layers it does not convert)."""
    import torch  # this module is torch-free; a step plan is only ever built with torch loaded

    assert run.device is not None
    device_type = run.device.autocast_device_type
    options = run.section(AutocastKwargs)  # each default declared once, on the class
    enabled = bool(options.enabled)
    extra = {} if options.cache_enabled is None else {"cache_enabled": bool(options.cache_enabled)}

    def autocast() -> Any:
        return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled, **extra)

    plan.set("autocast", autocast)


def install_loss_scaling(plan: StepPlanBuilder, scaler: Any) -> None:
    """Set ``backward``, ``unscale_gradients`` and ``optimizer_step`` to go through ``scaler``
    (a ``torch.amp.GradScaler`` or FSDP's ``ShardedGradScaler``): fp16 training, for the fp16
    precision plugin and for strategies that bring their own scaler."""
    unscaled: set[int] = set()

    def backward(loss: Any, **kwargs: Any) -> None:
        scaler.scale(loss).backward(**kwargs)

    def unscale_gradients(optimizer: Any) -> None:
        if id(optimizer) not in unscaled:  # GradScaler refuses a second unscale_ before update()
            scaler.unscale_(optimizer)
            unscaled.add(id(optimizer))

    def optimizer_step(optimizer: Any) -> bool:
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        unscaled.discard(id(optimizer))
        return scaler.get_scale() >= scale_before  # False: an overflow skipped the step

    plan.set("backward", backward)
    plan.set("unscale_gradients", unscale_gradients)
    plan.set("optimizer_step", optimizer_step)
    plan.loss_scaler = scaler


def unused_grad_scaler_options(run: RunContext, plan: StepPlanBuilder) -> str | None:
    """Why the ``grad_scaler_kwargs`` a source set do nothing in this plan (no GradScaler: bf16,
    fp32, a strategy that scales the loss its own way), or None when they are used or unset."""
    if plan.loss_scaler is not None:
        return None
    keys = [f"{GRAD_SCALER_SECTION}.{field.name}" for field in attrs.fields(GradScalerKwargs)]
    given = [key for key in keys if run.config.is_set(key)]
    if not given:
        return None
    source = run.config.sources[given[0]]
    precision = run.config.get("mixed_precision")
    return (f"{GRAD_SCALER_SECTION} ({source}) has no effect: no GradScaler scales the loss in this run "
            f"(mixed_precision {precision!r}; torch's GradScaler runs under fp16 only, and a strategy that owns "
            "precision configures its own loss scaling); remove it, or train in fp16")


__all__ = ["SLOTS", "StepPlan", "StepPlanBuilder", "default_slots", "grad_scaler_kwargs", "install_autocast",
           "install_loss_scaling", "unused_grad_scaler_options"]
