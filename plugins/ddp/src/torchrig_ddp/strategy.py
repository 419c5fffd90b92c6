"""The ``ddp`` strategy's runtime: ``torch.nn.parallel.DistributedDataParallel``.

DDP owns nothing the core cares about except gradient synchronisation: the precision plugin's
autocast and GradScaler apply unchanged, checkpoints are plain state dicts written by the main
process (the core's default), and accumulation uses DDP's ``no_sync()`` on the micro-steps, so
those make no gradient communication and the step that syncs makes one round.

Under ``torchrig plan`` (``run.planning``) no ``DistributedDataParallel`` is built (its reducer needs
real storage) and nothing moves: :mod:`torchrig_ddp.planning`'s stand-in issues the same collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torchrig.plugin import Capabilities, PlanningUnsupported, PreparedModel, RunContext, StepPlanBuilder, hookimpl

from torchrig_ddp.constants import POWER_SGD_HOOKS
from torchrig_ddp.options import DistributedDataParallelKwargs
from torchrig_ddp.planning import PlannedDistributedDataParallel


class DDPStrategy:
    @hookimpl
    def torchrig_strategy_capabilities(self, run: RunContext) -> Capabilities:
        return Capabilities(replicated_parameters=True, data_parallel_size=run.cluster.world_size,
                            data_parallel_rank=run.cluster.rank)

    @hookimpl
    def torchrig_prepare_model(
        self, run: RunContext, model: Any, optimizers: Sequence[Any], schedulers: Sequence[Any], device_placement: bool
    ) -> PreparedModel:
        assert run.device is not None
        device = run.device.device
        if device_placement and not run.planning:  # a planned model stays on the meta device
            model.to(device)
        prepared = PreparedModel(model=model, unwrapped=model, optimizers=list(optimizers), schedulers=list(schedulers))
        if run.cluster.world_size <= 1:
            return prepared  # one process: nothing to synchronise, no wrapper cost
        if not any(p.requires_grad for p in model.parameters()):
            return prepared  # a frozen model (teacher, EMA): DDP refuses it and it needs no gradient sync
        options = run.section(DistributedDataParallelKwargs)
        if run.planning:
            prepared.model = _planning_stand_in(model, options)
            return prepared
        extra: dict[str, Any] = {}
        if not options.broadcast_buffers:
            # torch 2.13 deprecates the argument, but only `broadcast_buffers=False` also skips the
            # buffer sync at construction, which is what this option has always meant; True is
            # DDP's default and is not passed (no deprecation warning).
            extra["broadcast_buffers"] = False
        ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            output_device=device.index if device.type == "cuda" else None,
            dim=options.dim,
            bucket_cap_mb=options.bucket_cap_mb,
            find_unused_parameters=options.find_unused_parameters,
            gradient_as_bucket_view=options.gradient_as_bucket_view,
            static_graph=options.static_graph,
            **extra,
        )
        _register_comm_hook(ddp, str(options.comm_hook), str(options.comm_wrapper), options.comm_state_option or {})
        prepared.model = ddp
        return prepared

    @hookimpl
    def torchrig_strategy_step_plan(self, run: RunContext, plan: StepPlanBuilder) -> None:
        def no_sync(model: Any) -> Any:
            if isinstance(model, (DistributedDataParallel, PlannedDistributedDataParallel)):
                return model.no_sync()
            return contextlib.nullcontext()

        plan.set("no_sync", no_sync)


def _planning_stand_in(model: Any, options: DistributedDataParallelKwargs) -> PlannedDistributedDataParallel:
    """``torchrig plan``: what DistributedDataParallel(model, ...) would communicate, on the meta device
    (:mod:`torchrig_ddp.planning`). Options that change no traffic (``dim``, ``check_reduction``) need nothing;
    ``gradient_as_bucket_view`` changes where gradients live, which the stand-in follows."""
    if options.comm_hook in POWER_SGD_HOOKS:
        raise PlanningUnsupported(
            f"strategy 'ddp' with ddp_config.comm_hook {options.comm_hook!r} is not planned: PowerSGD all-reduces "
            "whole buckets for its first start_powerSGD_iter steps, then low-rank factors per matrix whose sizes "
            "depend on the rank and the compression filter; plan with comm_hook no (its warm-up traffic) instead")
    compress = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(options.comm_hook))
    return PlannedDistributedDataParallel(
        model, process_group=None, bucket_cap_mb=options.bucket_cap_mb,
        find_unused_parameters=options.find_unused_parameters, static_graph=options.static_graph,
        gradient_as_bucket_view=options.gradient_as_bucket_view, broadcast_buffers=options.broadcast_buffers,
        compress_to=compress)


def _register_comm_hook(ddp: DistributedDataParallel, hook: str, wrapper: str, state_options: dict[str, Any]) -> None:
    """Gradient compression hooks (validated by the manifest before any process started)."""
    if hook == "no":
        return
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook in ("fp16", "bf16"):
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook if hook == "fp16" else default_hooks.bf16_compress_hook)
        return
    state = powerSGD_hook.PowerSGDState(process_group=None, **state_options)
    function = powerSGD_hook.powerSGD_hook if hook == "power_sgd" else powerSGD_hook.batched_powerSGD_hook
    if wrapper == "fp16":
        function = default_hooks.fp16_compress_wrapper(function)
    elif wrapper == "bf16":
        function = default_hooks.bf16_compress_wrapper(function)
    ddp.register_comm_hook(state, function)


__all__ = ["DDPStrategy"]
