"""The ``fp8`` precision's runtime: torchao ``Float8Linear`` for the chosen Linear layers, bf16 for
the rest, and FSDP2's fp8 all-gather when the strategy shards with ``fully_shard``.

Order (docs/precision.md): the conversion runs in ``torchrig_convert_model``, before the strategy
wraps the model and before compile. What is not converted computes in bf16: through autocast
(installed in the step plan, as the ``bf16`` precision does), or — when the strategy owns precision
(FSDP2) — through its mixed-precision policy. With the fp8 all-gather on, the weights' fp8 scales
are precomputed with one all-reduce after each optimizer step (torchao's
``precompute_float8_dynamic_scale_for_fsdp``), wrapped around the plan's ``optimizer_step``.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrig.plugin import RunContext, StepPlanBuilder, get_logger, hookimpl, install_autocast

from torchrig_fp8.config_checks import device_problem, hardware_problem
from torchrig_fp8.convert import ConversionReport, convert, import_float8
from torchrig_fp8.options import SECTION, AORecipeKwargs

logger = get_logger(__name__)


class Float8Precision:
    """One instance per plugin host (per Accelerator)."""

    name = "fp8"

    def __init__(self) -> None:
        #: One report per converted model, in ``prepare`` order.
        self.reports: list[ConversionReport] = []
        #: Whether fp8 matmuls are emulated (the device cannot run them; the switch allowed it).
        self.emulate = False
        self._gathered: list[torch.nn.Module] = []

    @hookimpl
    def torchrig_configure(self, run: RunContext) -> None:
        """Refuse a device that cannot run fp8 unless the emulation switch is on."""
        assert run.device is not None
        device = str(run.device.device)
        problem = hardware_problem(run.config, device)
        if problem:
            raise RuntimeError(f"mixed_precision='fp8' cannot run on {device}: {problem}")
        self.emulate = device_problem(run.config, device) is not None

    def fsdp_float8_all_gather(self, run: RunContext, warn: bool = False) -> bool:
        """On when the strategy shards with ``fully_shard``, the recipe is tensorwise and the user
        did not turn it off (or a given ``Float8LinearConfig`` says so)."""
        options = run.section(AORecipeKwargs)
        assert run.capabilities is not None
        if not run.capabilities.fully_shard_parameters:
            if warn and options.enable_fsdp_float8_all_gather:
                logger.warning(f"fp8: {SECTION}.enable_fsdp_float8_all_gather has no effect: the strategy does not "
                               "shard parameters with fully_shard (FSDP2)")
            return False
        if options.config is not None:
            return bool(options.config.enable_fsdp_float8_all_gather)
        wanted = options.enable_fsdp_float8_all_gather
        return options.recipe == "tensorwise" if wanted is None else bool(wanted)

    @hookimpl
    def torchrig_convert_model(self, run: RunContext, model: Any) -> None:
        capabilities = run.capabilities
        assert capabilities is not None
        if capabilities.owns_precision and not capabilities.fully_shard_parameters:
            raise RuntimeError(
                "mixed_precision='fp8' cannot compose with this strategy: it applies precision itself (its engine "
                "keeps its own weights and casts, e.g. DeepSpeed) and does not shard with fully_shard, so torchao's "
                "Float8Linear would be bypassed or fight its casts; use the fsdp or ddp strategy for fp8, or bf16")
        report = convert(model, run.section(AORecipeKwargs), emulate=self.emulate,
                         fsdp_float8_all_gather=self.fsdp_float8_all_gather(run, warn=True))
        self.reports.append(report)
        if report.fsdp_float8_all_gather:
            self._gathered.append(model)
        if not report.converted:
            logger.warning(report.message() + " — nothing runs in fp8")
        else:
            logger.info(report.message())

    @hookimpl
    def torchrig_precision_step_plan(self, run: RunContext, plan: StepPlanBuilder) -> None:
        """bf16 autocast for what is not converted (Float8Linear casts its own inputs)."""
        install_autocast(run, plan, torch.bfloat16)

    @hookimpl
    def torchrig_wrap_step_plan(self, run: RunContext, plan: StepPlanBuilder) -> None:
        """After each applied optimizer step, precompute the fp8 scales of the all-gathered weights
        (one all-reduce for all of them), as torchao requires with the fp8 all-gather."""
        if not self.fsdp_float8_all_gather(run):
            return
        precompute = import_float8().precompute_float8_dynamic_scale_for_fsdp
        step = plan.get("optimizer_step")
        gathered = self._gathered

        def optimizer_step(optimizer: Any) -> bool:
            stepped = step(optimizer)
            if stepped:
                for model in gathered:
                    precompute(model)
            return stepped

        plan.set("optimizer_step", optimizer_step, owner=f"{plan.owner('optimizer_step')}+precision:fp8")


__all__ = ["Float8Precision"]
