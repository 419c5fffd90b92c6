"""The ``ddp`` strategy's runtime: ``torch.nn.parallel.DistributedDataParallel``.

DDP owns nothing the core cares about except gradient synchronisation: the precision plugin's
autocast and GradScaler apply unchanged, checkpoints are plain state dicts written by the main
process (the core's default), and accumulation uses DDP's ``no_sync()`` on the micro-steps, so
those make no gradient communication and the step that syncs makes one round.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from torch.nn.parallel import DistributedDataParallel
from torchrig.plugin import Capabilities, PreparedModel, RunContext, StepPlanBuilder, hookimpl

from torchrig_ddp.options import DistributedDataParallelKwargs


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
        if device_placement:
            model.to(device)
        prepared = PreparedModel(model=model, unwrapped=model, optimizers=list(optimizers), schedulers=list(schedulers))
        if run.cluster.world_size <= 1:
            return prepared  # one process: nothing to synchronise, no wrapper cost
        if not any(p.requires_grad for p in model.parameters()):
            return prepared  # a frozen model (teacher, EMA): DDP refuses it and it needs no gradient sync
        options = run.section(DistributedDataParallelKwargs)
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
            return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

        plan.set("no_sync", no_sync)


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
