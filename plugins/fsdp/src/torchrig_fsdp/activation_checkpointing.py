"""Activation checkpointing policies and activation offload, applied to the blocks the wrap policy chose
(``fsdp_config.activation_checkpointing*``, ``activation_offload*``; docs/memory.md says which to use when).

Each is installed on a block's ``forward`` (parameter names unchanged, unlike ``checkpoint_wrapper``) before
``fully_shard``, so under FSDP2 the recomputation in backward runs inside the block's hooks and finds its
parameters gathered; under a pipeline each stage's blocks are counted on their own.

* ``full``: every block's forward under non-reentrant ``torch.utils.checkpoint``: only its inputs are kept;
* ``every_k``: the same for every k-th block (the k-th, 2k-th, ... as torchtitan counts), the others keep all;
* ``selective``: every block under op-level selective checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of matmuls (every k-th one),
  attention kernels and reduce-scatters are kept, everything else (norms, activations, adds) is recomputed;
* ``memory_budget``: no eager wrapper: ``torch._functorch.config.activation_memory_budget`` lets
  ``torch.compile``'s min-cut partitioner choose what to recompute to fit the budget (0: recompute all,
  1: keep all), so it needs ``torch.compile`` (refused without, before launch and at prepare).

Offload packs the tensors a block saves for backward (a checkpointed block: the inputs it keeps) into CPU memory
with ``torch.autograd.graph.save_on_cpu``'s hooks (pinned when CUDA is available) and counts them
(:func:`offload_stats`): the effect can be checked on any machine. Tensors already in CPU memory are kept as they
are (nothing to move).
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torchrig.plugin import RunContext, TorchDynamoPlugin

from torchrig_fsdp.constants import SECTION
from torchrig_fsdp.explain import FSDPConfigError
from torchrig_fsdp.options import AC_POLICIES as POLICIES
from torchrig_fsdp.options import FullyShardedDataParallelPlugin

logger = logging.getLogger(__name__)
_aten = torch.ops.aten
#: Matrix products: kept by ``selective`` (every k-th of a block's, counted in forward and recompute alike).
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})
#: Always kept by ``selective``: attention kernels (expensive, small outputs) and reduce-scatters (a
#: collective recomputed would run again in backward).
ALWAYS_SAVED = frozenset(
    getattr(namespace, name).default
    for namespace, name in (
        (_aten, "_scaled_dot_product_flash_attention"),
        (_aten, "_scaled_dot_product_efficient_attention"),
        (_aten, "_scaled_dot_product_cudnn_attention"),
        (_aten, "_scaled_dot_product_flash_attention_for_cpu"),
        (torch.ops._c10d_functional, "reduce_scatter_tensor"),
    )
    if hasattr(namespace, name)
)


def resolved_policy(options: FullyShardedDataParallelPlugin) -> str | None:
    """The policy in force: ``activation_checkpointing_policy``, else ``full`` when Accelerate's
    ``activation_checkpointing`` bool is on, else None (no checkpointing)."""
    if options.activation_checkpointing_policy is not None:
        return options.activation_checkpointing_policy
    return "full" if options.activation_checkpointing else None


def wanted(options: FullyShardedDataParallelPlugin) -> bool:
    """Whether checkpointing or offload is configured (else the blocks are not even looked for)."""
    return resolved_policy(options) is not None or options.activation_offload


def compiles(run: RunContext) -> bool:
    """Whether the Accelerator will ``torch.compile`` the prepared model (``dynamo_config``)."""
    dynamo = run.section(TorchDynamoPlugin)
    return dynamo.backend != "no" and not dynamo.disable


def install(run: RunContext, root: torch.nn.Module, blocks: Sequence[torch.nn.Module],
            options: FullyShardedDataParallelPlugin) -> None:
    """:func:`apply` for a run: ``blocks`` are ``root``'s wrapped blocks (``wrap_blocks``)."""
    if wanted(options):
        if resolved_policy(options) is not None:
            without_kv_cache(root)
        apply(blocks, options, compiled=compiles(run))


def without_kv_cache(root: torch.nn.Module) -> None:
    """Turn off the key/value cache of the transformers models in ``root`` (``config.use_cache``), as
    transformers' own gradient checkpointing does: a checkpointed layer that updates a cache in forward
    recomputes against a changed cache (selective checkpointing refuses it: "invocation ... not found")."""
    for module in root.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True:
            logger.info("activation checkpointing: %s.config.use_cache set to False (no key/value cache while "
                        "training with checkpointed layers)", type(module).__name__)
            config.use_cache = False


def every_kth(blocks: Sequence[torch.nn.Module], k: int) -> list[torch.nn.Module]:
    """Blocks k, 2k, ... (1-based, in forward order)."""
    return [block for index, block in enumerate(blocks, start=1) if index % k == 0]


def apply(blocks: Sequence[torch.nn.Module], options: FullyShardedDataParallelPlugin, *, compiled: bool) -> None:
    """Install the configured checkpointing policy, then offload, on ``blocks`` (one root's, in forward order).

    Offload wraps the checkpointed forward from outside: a checkpointed block's hooks see the inputs it keeps for
    the recomputation (what DeepSpeed calls checkpoint offload; ``selective`` keeps its saved op outputs in its own
    cache, on the device), a block left alone's see everything it saves."""
    policy = resolved_policy(options)
    key = f"{SECTION}.activation_checkpointing_every_k"
    if not blocks and (options.activation_offload or policy not in (None, "memory_budget")):
        raise FSDPConfigError(
            f"{SECTION}.activation_checkpointing_policy / activation_offload act on wrapped blocks, and this model (or "
            "pipeline stage) has none: set transformer_layer_cls_to_wrap to the class of its repeated blocks (or "
            "auto_wrap_policy SIZE_BASED_WRAP); under a pipeline, pp_split_points that give every stage a block")
    if policy == "memory_budget":
        set_memory_budget(options.activation_checkpointing_memory_budget, compiled=compiled)
    elif policy == "selective":
        context_fn = selective_context_fn(options.activation_checkpointing_matmul_every_k or 1)
        for block in blocks:
            checkpoint_forward(block, context_fn=context_fn)
    elif policy is not None:
        chosen = list(blocks) if policy == "full" else every_kth(blocks, options.activation_checkpointing_every_k or 2)
        if blocks and not chosen:
            raise FSDPConfigError(f"{key} ({options.activation_checkpointing_every_k}) is larger than the number of "
                                  f"wrapped blocks ({len(blocks)}), so no block would be checkpointed; lower it")
        for block in chosen:
            checkpoint_forward(block)
    if options.activation_offload:
        chosen = every_kth(blocks, options.activation_offload_every_k or 1)
        if blocks and not chosen:
            raise FSDPConfigError(f"{SECTION}.activation_offload_every_k ({options.activation_offload_every_k}) is "
                                  f"larger than the number of wrapped blocks ({len(blocks)}), so nothing would be "
                                  "offloaded; lower it")
        for block in chosen:
            offload_forward(block)


def checkpoint_forward(block: torch.nn.Module, context_fn: Callable[[], Any] | None = None) -> None:
    """Run ``block``'s forward under non-reentrant ``torch.utils.checkpoint`` (with ``context_fn``: selective)."""
    forward = block.forward
    extra = {} if context_fn is None else {"context_fn": context_fn}

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = checkpointed


def selective_context_fn(matmul_every_k: int) -> Callable[[], Any]:
    """Op-level SAC: keep every ``matmul_every_k``-th matmul output of a block (1st, (k+1)-th, ...), attention and
    reduce-scatter outputs; recompute the rest. The count restarts for each block call and is kept apart for
    forward and recompute, so both take the same decisions."""

    def context_fn() -> Any:
        counts: dict[bool, int] = defaultdict(int)

        def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if func in ALWAYS_SAVED:
                return CheckpointPolicy.MUST_SAVE
            if func in MATMULS:
                counts[ctx.is_recompute] += 1
                if (counts[ctx.is_recompute] - 1) % matmul_every_k == 0:
                    return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def set_memory_budget(budget: float | None, *, compiled: bool) -> None:
    """Give ``torch.compile``'s partitioner the activation budget (process-wide: torch has one setting)."""
    key = f"{SECTION}.activation_checkpointing_memory_budget"
    if budget is None:
        raise FSDPConfigError(f"{key} is not set, but activation_checkpointing_policy is memory_budget; set it to a "
                              "fraction in [0, 1] of the activations to keep (0: recompute all, 1: keep all)")
    if not compiled:
        raise FSDPConfigError(
            f"{key} ({budget}) acts only through torch.compile's partitioner, and this run does not compile "
            "(dynamo_config.backend is 'no'): set dynamo_config.backend (e.g. --dynamo_backend inductor), or choose "
            "activation_checkpointing_policy full, every_k or selective, which work eagerly")
    functorch_config.activation_memory_budget = budget


@dataclass
class OffloadStats:
    """What a block's offload hooks packed: tensors, their bytes, how many went to pinned memory."""

    packed: int = 0
    bytes: int = 0
    pinned: int = 0


def offload_stats(block: torch.nn.Module) -> OffloadStats:
    """The offload counters of ``block`` (all zero when its saved tensors are not offloaded)."""
    return getattr(block, "_torchrig_offload_stats", None) or OffloadStats()


def offload_forward(block: torch.nn.Module) -> None:
    """Pack the tensors ``block``'s forward saves for backward into CPU memory (torch's ``save_on_cpu``)."""
    stats = OffloadStats()
    forward = block.forward
    pin_memory = torch.cuda.is_available()

    @functools.wraps(forward)
    def offloaded(*args: Any, **kwargs: Any) -> Any:
        to_cpu = torch.autograd.graph.save_on_cpu(pin_memory=pin_memory)

        def pack(tensor: torch.Tensor) -> Any:
            stats.packed += 1
            stats.bytes += tensor.numel() * tensor.element_size()
            if tensor.device.type == "cpu":
                return (False, tensor)
            packed = to_cpu.pack_hook(tensor)
            stats.pinned += int(packed[1].is_pinned())
            return (True, packed)

        def unpack(packed: Any) -> torch.Tensor:
            moved, value = packed
            return to_cpu.unpack_hook(value) if moved else value

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return forward(*args, **kwargs)

    block.forward = offloaded
    block._torchrig_offload_stats = stats


__all__ = ["POLICIES", "OffloadStats", "apply", "checkpoint_forward", "compiles", "every_kth", "install",
           "offload_forward", "offload_stats", "resolved_policy", "selective_context_fn", "set_memory_budget", "wanted",
           "without_kv_cache"]
