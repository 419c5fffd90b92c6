"""FSDP2's configuration checks (``torchrig_validate_config``): what ``fully_shard`` would reject, or
silently do differently, found before launch (the decisions are listed in :mod:`torchrig_fsdp.manifest`).

Reads the typed sections — :class:`~torchrig_fsdp.options.FullyShardedDataParallelPlugin` and the
core's :class:`CoreOptions`, :class:`ParallelismConfig`, :class:`DataLoaderConfiguration` — whose
classes hold the only defaults. Torch-free at import: torch is imported only when ``cpu_offload``
is on.
"""

from __future__ import annotations

from collections.abc import Mapping

from torchrig.plugin import (
    ConfigProblem,
    CoreOptions,
    DataLoaderConfiguration,
    ParallelismConfig,
    ResolvedConfig,
    TorchDynamoPlugin,
)

from torchrig_fsdp.constants import HYBRID, SECTION
from torchrig_fsdp.hf_style_names import REFUSED_STYLES
from torchrig_fsdp.options import FullyShardedDataParallelPlugin


def fsdp_problems(config: ResolvedConfig) -> list[ConfigProblem]:
    problems: list[ConfigProblem] = []
    fsdp = config.section_of(FullyShardedDataParallelPlugin)
    core = config.section_of(CoreOptions)
    mesh = config.section_of(ParallelismConfig)
    if fsdp.cpu_offload:
        problem = _offload_problem(core)
        if problem:
            problems.append(ConfigProblem(f"{SECTION}.cpu_offload", problem))
    strategy = fsdp.sharding_strategy
    machines, processes = core.num_machines or 1, core.num_processes
    if strategy in HYBRID and processes and machines > 1 and processes % machines:
        problems.append(ConfigProblem(f"{SECTION}.sharding_strategy", (
            f"{strategy} shards within each machine and replicates across machines, so num_processes ({processes}) "
            f"must be a multiple of num_machines ({machines})")))
    if fsdp.cpu_ram_efficient_loading and not fsdp.sync_module_states:
        problems.append(ConfigProblem(f"{SECTION}.cpu_ram_efficient_loading", (
            "needs sync_module_states: true: only rank 0 loads the weights, the other ranks receive them by the "
            "broadcast that sync_module_states performs")))
    sizes = {axis: getattr(mesh, f"{axis}_size") for axis in ("dp_replicate", "dp_shard", "tp", "cp", "pp")}
    if strategy in (*HYBRID, "NO_SHARD") and any(size != 1 for size in sizes.values()):
        problems.append(ConfigProblem(f"{SECTION}.sharding_strategy", (
            f"{strategy} and parallelism_config both describe the mesh; with parallelism_config set "
            "parallelism_config.dp_replicate_size (replicas) and dp_shard_size (shards per replica) instead")))
    if core.mixed_precision == "fp16" and sizes["tp"] not in (1, None) and all(
            sizes[axis] == 1 for axis in ("dp_replicate", "dp_shard")):
        problems.append(ConfigProblem("mixed_precision", (
            "fp16 with tensor parallel alone (no dp_shard/dp_replicate axis) is not supported: the loss scaler cannot "
            "unscale plain and tensor-parallel gradients together; use bf16, or add a data axis "
            "(parallelism_config.dp_shard_size)")))
    shared = [f"{axis}_size={sizes[axis]}" for axis in ("cp", "tp") if sizes[axis] != 1]
    if config.section_of(DataLoaderConfiguration).dispatch_batches and shared:
        problems.append(ConfigProblem("dataloader_config.dispatch_batches", (
            f"the main process would send batches to every rank, but with {' and '.join(shared)} the ranks of one "
            "tensor/context-parallel group must get the same batch; set dispatch_batches: false (each data-parallel "
            "rank reads its own)")))
    if mesh.async_tp and _uses_cpu(core):
        problems.append(ConfigProblem("parallelism_config.async_tp", (
            "needs CUDA devices (its overlap uses symmetric-memory kernels torch has for CUDA only) but this run uses "
            "the CPU (use_cpu/device); set async_tp: false")))
    plan = mesh.tp_plan
    for pattern, style in (plan.items() if isinstance(plan, Mapping) else ()):
        if style in REFUSED_STYLES:  # known names the runtime cannot honour: said before launch, not at prepare
            problems.append(ConfigProblem("parallelism_config.tp_plan", (
                f"{pattern!r}: style {style!r} is refused: {REFUSED_STYLES[style]}")))
    problems.extend(activation_problems(fsdp, config.section_of(TorchDynamoPlugin)))
    return problems


def activation_problems(fsdp: FullyShardedDataParallelPlugin, dynamo: TorchDynamoPlugin) -> list[ConfigProblem]:
    """Activation checkpointing and offload: an option its policy does not read, a policy with nothing to act on,
    and ``memory_budget`` without ``torch.compile`` (the only thing that reads it)."""
    problems: list[ConfigProblem] = []
    policy = fsdp.activation_checkpointing_policy or ("full" if fsdp.activation_checkpointing else None)
    key = f"{SECTION}.activation_checkpointing_policy" if fsdp.activation_checkpointing_policy else \
        f"{SECTION}.activation_checkpointing"
    for option, owner in (("every_k", "every_k"), ("matmul_every_k", "selective"), ("memory_budget", "memory_budget")):
        if getattr(fsdp, f"activation_checkpointing_{option}") is not None and policy != owner:
            problems.append(ConfigProblem(f"{SECTION}.activation_checkpointing_{option}", (
                f"is read by activation_checkpointing_policy {owner} only, but the policy is {policy or 'unset (off)'}; "
                f"set activation_checkpointing_policy: {owner}, or remove it")))
    if fsdp.activation_offload_every_k is not None and not fsdp.activation_offload:
        problems.append(ConfigProblem(f"{SECTION}.activation_offload_every_k", (
            "is read by activation_offload only, which is off; set activation_offload: true, or remove it")))
    if policy in ("full", "every_k", "selective") and fsdp.auto_wrap_policy == "NO_WRAP":
        problems.append(ConfigProblem(key, (
            f"{policy} checkpoints wrapped blocks, but auto_wrap_policy is NO_WRAP (no blocks); use "
            "TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP")))
    if fsdp.activation_offload and fsdp.auto_wrap_policy == "NO_WRAP":
        problems.append(ConfigProblem(f"{SECTION}.activation_offload", (
            "offloads what wrapped blocks save, but auto_wrap_policy is NO_WRAP (no blocks); use "
            "TRANSFORMER_BASED_WRAP or SIZE_BASED_WRAP")))
    if policy == "memory_budget":
        budget_key = f"{SECTION}.activation_checkpointing_memory_budget"
        if fsdp.activation_checkpointing_memory_budget is None:
            problems.append(ConfigProblem(budget_key, (
                "is not set, but activation_checkpointing_policy is memory_budget; set it to the fraction in [0, 1] of "
                "the activations to keep (0: recompute all, 1: keep all)")))
        elif dynamo.backend == "no" or dynamo.disable:
            problems.append(ConfigProblem(budget_key, (
                "acts only through torch.compile's partitioner, and this run does not compile (dynamo_config.backend "
                "is 'no'); set dynamo_config.backend (--dynamo_backend inductor), or choose activation_checkpointing_policy "
                "full, every_k or selective, which work eagerly")))
    return problems


def _uses_cpu(core: CoreOptions) -> bool:
    return bool(core.use_cpu) or core.device == "cpu"


def _offload_problem(core: CoreOptions) -> str | None:
    fix = ("set cpu_offload: false (Accelerate: fsdp_offload_params: false); on the CPU the parameters are in CPU "
           "memory already")
    if _uses_cpu(core):
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


__all__ = ["activation_problems", "fsdp_problems"]
