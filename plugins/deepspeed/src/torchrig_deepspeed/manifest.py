"""Manifest of the ``deepspeed`` strategy: options, flags and checks, importable without torch or DeepSpeed.

The validation hook (run only when ``deepspeed`` is the selected strategy) imports DeepSpeed lazily
to derive the keys it reads; see :mod:`torchrig_deepspeed.config_checks`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrig.plugin import HOOK_API_VERSION, CliFlag, ConfigProblem, ConfigSection, PluginManifest, hookimpl

from torchrig_deepspeed.constants import OFFLOAD_DEVICES, SECTION

if TYPE_CHECKING:
    from torchrig.plugin import MemoryEstimate, MemoryRequest, ResolvedConfig


class DeepSpeedManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "DeepSpeed ZeRO stages 0-3, with CPU/NVMe offload"
    install_hint = "torchrig[deepspeed]"
    requires = ("deepspeed",)
    aliases = ("DEEPSPEED",)
    parallelism_axes = ("dp_shard",)  # ZeRO shards over every rank
    distributed_type = "DEEPSPEED"
    state_attribute = "deepspeed_plugin"
    exports = {"DeepSpeedPlugin": "torchrig_deepspeed.options:DeepSpeedPlugin",
               "DummyOptim": "torchrig_deepspeed.placeholders:DummyOptim",
               "DummyScheduler": "torchrig_deepspeed.placeholders:DummyScheduler",
               "GatheredParameters": "torchrig_deepspeed.compat:GatheredParameters",
               "get_active_deepspeed_plugin": "torchrig_deepspeed.compat:get_active_deepspeed_plugin"}
    config_section = ConfigSection(
        SECTION, "torchrig_deepspeed.options:DeepSpeedPlugin",
        help="DeepSpeedPlugin: ZeRO stage, offload, clipping and the DeepSpeed JSON (deepspeed_config_file)",
    )
    cli_flags = (
        CliFlag("--use_deepspeed", "strategy", "use the deepspeed strategy", type="const", const="deepspeed"),
        CliFlag("--zero_stage", f"{SECTION}.zero_stage", "DeepSpeed ZeRO stage (0-3)", type="int"),
        CliFlag("--deepspeed_config_file", f"{SECTION}.hf_ds_config", "DeepSpeed JSON config file", metavar="FILE"),
        CliFlag("--offload_optimizer_device", f"{SECTION}.offload_optimizer_device", "none, cpu or nvme",
                choices=OFFLOAD_DEVICES),
        CliFlag("--offload_param_device", f"{SECTION}.offload_param_device", "none, cpu or nvme (ZeRO-3)",
                choices=OFFLOAD_DEVICES),
        CliFlag("--offload_optimizer_nvme_path", f"{SECTION}.offload_optimizer_nvme_path",
                "directory for nvme optimizer offload"),
        CliFlag("--offload_param_nvme_path", f"{SECTION}.offload_param_nvme_path",
                "directory for nvme parameter offload"),
        CliFlag("--gradient_clipping", f"{SECTION}.gradient_clipping", "clip gradients to this global norm",
                type="float"),
        CliFlag("--zero3_init_flag", f"{SECTION}.zero3_init_flag", "build the model under deepspeed.zero.Init (ZeRO-3)",
                type="bool"),
        CliFlag("--zero3_save_16bit_model", f"{SECTION}.zero3_save_16bit_model", "ZeRO-3: save a gathered 16-bit model",
                type="bool"),
        CliFlag("--deepspeed_moe_layer_cls_names", f"{SECTION}.deepspeed_moe_layer_cls_names",
                "MoE layer class names (comma-separated)", type="list"),
    )

    @hookimpl
    def torchrig_estimate_memory(self, request: MemoryRequest) -> MemoryEstimate:
        """Per-rank memory under this strategy (``torchrig estimate-memory``); see :mod:`torchrig_deepspeed.memory`
        (imported here: a run that never estimates loads only the manifest)."""
        from torchrig_deepspeed.memory import deepspeed_estimate

        return deepspeed_estimate(request)

    @hookimpl
    def torchrig_validate_config(self, config: ResolvedConfig) -> list[ConfigProblem]:
        """The DeepSpeed JSON against DeepSpeed's own key set and parser, and against torchrig's
        configuration (precision, batch arithmetic, stage, offload), all problems at once (imported
        here: the checks read the typed section, so they import the options class, which a run
        without deepspeed never loads — benchmark B12)."""
        from torchrig_deepspeed.config_checks import deepspeed_problems

        return deepspeed_problems(config)


__all__ = ["DeepSpeedManifest"]
