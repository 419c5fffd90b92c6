"""Manifest of the ``fsdp`` strategy (FSDP2, ``fully_shard``): its options, flags and checks, torch-free.

Decisions the checks (:mod:`torchrig_fsdp.config_checks`) encode (see also ``torchrig_fsdp.options``):

* ``cpu_offload`` without an accelerator (or with ``use_cpu``) is an error: FSDP2's
  ``CPUOffloadPolicy`` moves shards between accelerator memory and pinned CPU memory, and pinning
  raises without an accelerator; on the CPU the parameters are in CPU memory already.
* ``HYBRID_SHARD``/``_HYBRID_SHARD_ZERO2`` build a (num_machines, processes per machine) mesh:
  ``num_processes`` must divide evenly by ``num_machines``. On one machine the mesh is (1, N), which
  is ``FULL_SHARD``/``SHARD_GRAD_OP``: allowed, so the same file works on one machine and on several.
* ``reshard_after_forward``, when set, wins over what ``sharding_strategy`` implies (it is FSDP2's
  own knob; Accelerate's FSDP2 path does the same); ``sharding_strategy`` still picks the mesh.
* ``SIZE_BASED_WRAP`` without ``min_num_params`` uses 100_000_000 (torch's default);
  ``TRANSFORMER_BASED_WRAP`` without classes is fine here: the runtime uses the model's
  ``_no_split_modules``; a model declaring none is an error when the policy was written in a file,
  variable or flag, and shards only the root (logged) when the policy is the default
  (``docs/fsdp.md``). Only the model can tell, so this is checked at ``prepare``.
* ``mixed_precision: fp16`` is allowed: the runtime scales the loss with a sharded grad scaler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchrig.plugin import HOOK_API_VERSION, TP_STYLES, CliFlag, ConfigProblem, ConfigSection, PluginManifest, hookimpl

from torchrig_fsdp.constants import (
    AUTO_WRAP_POLICIES,
    BACKWARD_PREFETCH,
    SECTION,
    SHARDING_STRATEGIES,
    STATE_DICT_TYPES,
)
from torchrig_fsdp.hf_style_names import TRANSFORMERS_STYLE_NAMES

if TYPE_CHECKING:
    from torchrig.plugin import ResolvedConfig


class FSDPManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "FSDP2 (fully_shard): parameters, gradients and optimizer state sharded across ranks"
    install_hint = "torchrig[fsdp]"
    requires = ()  # torch is a dependency of torchrig itself
    aliases = ("FSDP",)
    parallelism_axes = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")  # the N-D mesh: torchrig_fsdp.mesh; ep: expert_parallel
    # a tp_plan may use torchrig's names and transformers' (copied from a model's _tp_plan); hf_styles maps them
    tp_styles = tuple(dict.fromkeys((*TP_STYLES, *TRANSFORMERS_STYLE_NAMES)))
    distributed_type = "FSDP"
    state_attribute = "fsdp_plugin"
    exports = {
        "FullyShardedDataParallelPlugin": "torchrig_fsdp.options:FullyShardedDataParallelPlugin",
        "merge_fsdp_weights": "torchrig_fsdp.merge:merge_fsdp_weights",
    }
    config_section = ConfigSection(
        SECTION, "torchrig_fsdp.options:FullyShardedDataParallelPlugin",
        help="FullyShardedDataParallelPlugin (FSDP2); Accelerate's fsdp_* keys are accepted",
    )
    cli_flags = (
        CliFlag("--use_fsdp", "strategy", "use the fsdp strategy (FSDP2)", type="const", const="fsdp"),
        CliFlag("--fsdp_sharding_strategy", f"{SECTION}.sharding_strategy", "FSDP sharding strategy",
                choices=SHARDING_STRATEGIES),
        CliFlag("--fsdp_auto_wrap_policy", f"{SECTION}.auto_wrap_policy", "which submodules are sharded separately",
                choices=AUTO_WRAP_POLICIES),
        CliFlag("--fsdp_transformer_layer_cls_to_wrap", f"{SECTION}.transformer_layer_cls_to_wrap",
                "comma-separated class names for TRANSFORMER_BASED_WRAP", type="list"),
        CliFlag("--fsdp_min_num_params", f"{SECTION}.min_num_params", "SIZE_BASED_WRAP threshold", type="int"),
        CliFlag("--fsdp_offload_params", f"{SECTION}.cpu_offload", "offload shards to CPU memory", type="bool"),
        CliFlag("--fsdp_state_dict_type", f"{SECTION}.state_dict_type", "checkpoint format",
                choices=STATE_DICT_TYPES),
        CliFlag("--fsdp_backward_prefetch", f"{SECTION}.backward_prefetch", "backward prefetch",
                choices=BACKWARD_PREFETCH),
        CliFlag("--fsdp_forward_prefetch", f"{SECTION}.forward_prefetch", "prefetch in forward", type="bool"),
        CliFlag("--fsdp_sync_module_states", f"{SECTION}.sync_module_states", "broadcast rank 0's weights",
                type="bool"),
        CliFlag("--fsdp_use_orig_params", f"{SECTION}.use_orig_params", "FSDP1-only, no effect", type="bool"),
        CliFlag("--fsdp_cpu_ram_efficient_loading", f"{SECTION}.cpu_ram_efficient_loading",
                "only rank 0 loads weights into CPU memory", type="bool"),
        CliFlag("--fsdp_activation_checkpointing", f"{SECTION}.activation_checkpointing",
                "recompute activations of wrapped blocks", type="bool"),
        CliFlag("--fsdp_reshard_after_forward", f"{SECTION}.reshard_after_forward",
                "free gathered parameters after forward", type="bool"),
        CliFlag("--fsdp_version", f"{SECTION}.fsdp_version", "2 (FSDP2)", type="int"),
    )

    @hookimpl
    def torchrig_validate_config(self, config: ResolvedConfig) -> list[ConfigProblem]:
        """What FSDP2 would reject at ``fully_shard`` time, or silently do differently, found before launch;
        see :mod:`torchrig_fsdp.config_checks` (imported here: it reads the typed section, so it imports the
        options class, which a run without fsdp never loads — benchmark B12)."""
        from torchrig_fsdp.config_checks import fsdp_problems

        return fsdp_problems(config)


__all__ = ["FSDPManifest"]
