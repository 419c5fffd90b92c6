"""Gradient clipping under DeepSpeed: the engine clips inside its ``step`` to one
``gradient_clipping`` value.

``clip_grad_norm_(parameters, max_norm)`` sets that value on the engines owning ``parameters``
(when no configuration fixed another: a contradiction is an error naming where the value came
from) and returns the global 2-norm of the gradients the coming step clips — computed from each
rank's partition with one collective. ``clip_grad_value_`` is refused: DeepSpeed has no
per-value clipping.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torchrig.plugin import RunContext

from torchrig_deepspeed.config_checks import SECTION
from torchrig_deepspeed.engines import DeepSpeedStrategyError, EngineRecord, deepspeed_options


def clip_grad_norm(run: RunContext, records: Sequence[EngineRecord], parameters: Any, max_norm: float,
                   norm_type: float) -> torch.Tensor:
    """DeepSpeed clips inside ``engine.step`` to the engine's ``gradient_clipping``: make that
    ``max_norm`` (when no configuration fixed another value) and return the global 2-norm of the
    gradients the coming step will clip (on a micro-step that does not step: the last step's)."""
    if float(norm_type) != 2.0:
        raise DeepSpeedStrategyError(f"deepspeed: clip_grad_norm_(norm_type={norm_type}) is not supported: DeepSpeed "
                                     "clips the global 2-norm; call it with norm_type=2")
    wanted = {id(p) for p in ([parameters] if isinstance(parameters, torch.Tensor) else parameters)}
    chosen = [r for r in records if r.params & wanted]
    if not chosen:
        raise DeepSpeedStrategyError("deepspeed: clip_grad_norm_ got no trainable parameter of a prepared model; pass "
                                     "model.parameters() of the prepared model")
    squares = 0.0
    for record in chosen:
        _apply_clipping(run, record, float(max_norm))
        squares += float(grad_norm(record)) ** 2
    return torch.tensor(squares ** 0.5)


def _apply_clipping(run: RunContext, record: EngineRecord, max_norm: float) -> None:
    engine = record.engine
    current = float(engine.gradient_clipping() or 0.0)
    if current == max_norm:
        return
    if not record.built.clipping_open:
        where = run.option_source(f"{SECTION}.gradient_clipping")
        origin = f"deepspeed_config.gradient_clipping ({where})" if deepspeed_options(run).gradient_clipping \
            is not None else "the DeepSpeed config's gradient_clipping"
        raise DeepSpeedStrategyError(
            f"deepspeed: clip_grad_norm_(max_norm={max_norm:g}) but the engine clips at {current:g}, set by {origin}; "
            "DeepSpeed clips inside its step with one value, so make them agree (or remove one)")
    engine._config.gradient_clipping = max_norm
    if hasattr(engine.optimizer, "clip_grad"):
        engine.optimizer.clip_grad = max_norm
    record.built.config["gradient_clipping"] = max_norm


def grad_norm(record: EngineRecord) -> float:
    """The global 2-norm of the engine's current (unscaled) gradients, with one collective.

    ZeRO-3 and ZeRO-1/2 (and DeepSpeed's bf16 optimizer) hold each rank's slice of every
    gradient: the squares of the slices are summed over the data-parallel group. Stage 0 keeps
    whole, already reduced gradients on every rank. Between boundaries gradients are not reduced
    yet: the norm of the last applied step is returned then."""
    import torch.distributed as dist

    engine = record.engine
    if not engine.is_gradient_accumulation_boundary():
        return float(engine.get_global_grad_norm() or 0.0)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    local = torch.zeros((), dtype=torch.float64)
    replicated = torch.zeros((), dtype=torch.float64)
    group = None
    if engine.zero_optimization_partition_weights():
        from deepspeed.utils import safe_get_local_grad

        for p in params:
            grad = safe_get_local_grad(p)
            if grad is not None:
                local += grad.detach().double().pow(2).sum().cpu()
        group = engine.optimizer.dp_process_group
    else:
        for p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if p.grad is not None and mapping is None and getattr(p, "_hp_grad", None) is None:
                replicated += p.grad.detach().double().pow(2).sum().cpu()
            elif hasattr(p, "_dp_group"):
                group = p._dp_group
                if mapping is not None:
                    local += _fragment(p, mapping).double().pow(2).sum().cpu()
    if group is not None and dist.is_initialized():
        # the sums are on the CPU (offloaded gradients, or .cpu() above); the group's backend takes
        # tensors of the run's device (NCCL: CUDA only)
        summed = local.to(engine.device)
        dist.all_reduce(summed, group=group)
        local = summed.cpu()
    scale = float(getattr(engine.optimizer, "loss_scale", 1.0) or 1.0) if engine.fp16_enabled() else 1.0
    return float((local + replicated).sqrt()) / scale


def _fragment(param: Any, mapping: Any) -> torch.Tensor:
    """This rank's slice of ``param``'s gradient (what DeepSpeed's ``get_full_hp_grad`` sums
    over ranks, without gathering the rest)."""
    fragment = mapping.get_lp_grad_fragment(param._index_in_param_group).detach().float().flatten()
    address = mapping.lp_fragment_address
    if fragment.numel() == param.numel() and address.numel != param.numel():
        fragment = fragment.narrow(0, address.start, address.numel)  # bf16: a full buffer per rank
    return fragment


def refuse_value_clipping(parameters: Any, clip_value: float) -> None:
    raise DeepSpeedStrategyError(
        "deepspeed: clip_grad_value_ is not supported: DeepSpeed clips the global gradient norm inside its step; use "
        "clip_grad_norm_(parameters, max_norm) or set deepspeed_config.gradient_clipping")


__all__ = ["clip_grad_norm", "grad_norm", "refuse_value_clipping"]
