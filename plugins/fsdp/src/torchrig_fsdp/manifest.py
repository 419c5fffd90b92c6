"""Manifest of the ``fsdp`` strategy (FSDP2, ``fully_shard``): its options, flags and checks, torch-free.

Decisions the checks encode (see also ``torchrig_fsdp.options``):

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

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torchrig.plugin import HOOK_API_VERSION, TP_STYLES, CliFlag, ConfigProblem, ConfigSection, PluginManifest, hookimpl

from torchrig_fsdp.hf_style_names import REFUSED_STYLES, TRANSFORMERS_STYLE_NAMES

if TYPE_CHECKING:
    from torchrig.plugin import MemoryEstimate, MemoryRequest

SECTION = "fsdp_config"
SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
BACKWARD_PREFETCH = ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH")
AUTO_WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT")
HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


class FSDPManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "FSDP2 (fully_shard): parameters, gradients and optimizer state sharded across ranks"
    install_hint = "torchrig[fsdp]"
    requires = ()  # torch is a dependency of torchrig itself
    aliases = ("FSDP",)
    parallelism_axes = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the N-D mesh: torchrig_fsdp.mesh
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
    def torchrig_estimate_memory(self, request: MemoryRequest) -> MemoryEstimate:
        """Per-rank memory under this strategy (``torchrig estimate-memory``); see :mod:`torchrig_fsdp.memory`
        (imported here: a run that never estimates loads only the manifest)."""
        from torchrig_fsdp.memory import fsdp_estimate

        return fsdp_estimate(request)

    @hookimpl
    def torchrig_validate_config(self, config: Mapping[str, Any]) -> list[ConfigProblem]:
        """What FSDP2 would reject at ``fully_shard`` time, or silently do differently, found before launch."""
        return fsdp_problems(config)


def fsdp_problems(config: Mapping[str, Any]) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    get = config.get
    if get(f"{SECTION}.cpu_offload"):
        problem = _offload_problem(config)
        if problem:
            problems.append(ConfigProblem(f"{SECTION}.cpu_offload", problem))
    strategy = get(f"{SECTION}.sharding_strategy")
    machines, processes = get("num_machines") or 1, get("num_processes")
    if strategy in HYBRID and processes and machines > 1 and processes % machines:
        problems.append(ConfigProblem(f"{SECTION}.sharding_strategy", (
            f"{strategy} shards within each machine and replicates across machines, so num_processes ({processes}) "
            f"must be a multiple of num_machines ({machines})")))
    if get(f"{SECTION}.cpu_ram_efficient_loading") and not get(f"{SECTION}.sync_module_states", True):
        problems.append(ConfigProblem(f"{SECTION}.cpu_ram_efficient_loading", (
            "needs sync_module_states: true: only rank 0 loads the weights, the other ranks receive them by the "
            "broadcast that sync_module_states performs")))
    mesh_sizes = [get(f"parallelism_config.{axis}_size", 1) for axis in ("dp_replicate", "dp_shard", "tp", "cp", "pp")]
    if strategy in (*HYBRID, "NO_SHARD") and any(size != 1 for size in mesh_sizes):
        problems.append(ConfigProblem(f"{SECTION}.sharding_strategy", (
            f"{strategy} and parallelism_config both describe the mesh; with parallelism_config set "
            "parallelism_config.dp_replicate_size (replicas) and dp_shard_size (shards per replica) instead")))
    tp = get("parallelism_config.tp_size", 1)
    data = [get(f"parallelism_config.{axis}_size", 1) for axis in ("dp_replicate", "dp_shard")]
    if get("mixed_precision") == "fp16" and tp not in (1, None) and all(size == 1 for size in data):
        problems.append(ConfigProblem("mixed_precision", (
            "fp16 with tensor parallel alone (no dp_shard/dp_replicate axis) is not supported: the loss scaler cannot "
            "unscale plain and tensor-parallel gradients together; use bf16, or add a data axis "
            "(parallelism_config.dp_shard_size)")))
    shared = [f"{axis}_size={get(f'parallelism_config.{axis}_size', 1)}" for axis in ("cp", "tp")
              if get(f"parallelism_config.{axis}_size", 1) != 1]
    if get("dataloader_config.dispatch_batches") and shared:
        problems.append(ConfigProblem("dataloader_config.dispatch_batches", (
            f"the main process would send batches to every rank, but with {' and '.join(shared)} the ranks of one "
            "tensor/context-parallel group must get the same batch; set dispatch_batches: false (each data-parallel "
            "rank reads its own)")))
    if get("parallelism_config.async_tp") and (get("use_cpu") or get("device") == "cpu"):
        problems.append(ConfigProblem("parallelism_config.async_tp", (
            "needs CUDA devices (its overlap uses symmetric-memory kernels torch has for CUDA only) but this run uses "
            "the CPU (use_cpu/device); set async_tp: false")))
    plan = get("parallelism_config.tp_plan")
    for pattern, style in (plan.items() if isinstance(plan, Mapping) else ()):
        if style in REFUSED_STYLES:  # known names the runtime cannot honour: said before launch, not at prepare
            problems.append(ConfigProblem("parallelism_config.tp_plan", (
                f"{pattern!r}: style {style!r} is refused: {REFUSED_STYLES[style]}")))
    if get(f"{SECTION}.activation_checkpointing") and get(f"{SECTION}.auto_wrap_policy") == "NO_WRAP":
        problems.append(ConfigProblem(f"{SECTION}.activation_checkpointing", (
            "checkpoints each wrapped block, but auto_wrap_policy is NO_WRAP (no blocks); use TRANSFORMER_BASED_WRAP "
            "or SIZE_BASED_WRAP")))
    return problems


def _offload_problem(config: Mapping[str, Any]) -> str | None:
    fix = ("set cpu_offload: false (Accelerate: fsdp_offload_params: false); on the CPU the parameters are in CPU "
           "memory already")
    if config.get("use_cpu") or config.get("device") == "cpu":
        return f"offloads from an accelerator to CPU memory, but this run uses the CPU (use_cpu/device); {fix}"
    if not _accelerator_available():
        return ("needs an accelerator: FSDP2's CPUOffloadPolicy moves shards between accelerator memory and pinned "
                f"CPU memory, and torch finds no accelerator on this machine; {fix}")
    return None


def _accelerator_available() -> bool:
    """Imports torch: called only when ``cpu_offload`` is on."""
    import torch

    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and hasattr(accelerator, "is_available"):
        if not accelerator.is_available():
            return False
        device = accelerator.current_accelerator()
        return device is not None and device.type != "mps"  # FSDP does not run on MPS
    return torch.cuda.is_available()


__all__ = ["FSDPManifest", "fsdp_problems"]
