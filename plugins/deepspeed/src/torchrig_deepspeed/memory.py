"""DeepSpeed ZeRO's per-rank memory (torch-free: estimating never imports deepspeed).

Parameters and gradients are in the compute dtype (the engine casts the module to fp16/bf16).
ZeRO 1 and 2 keep a flat fp32 copy of this rank's partition for the optimizer (even in fp32
training: ``single_partition_of_fp32_groups``), ZeRO 3 likewise (``fp32_partitioned_groups_flat``);
stage 0 keeps one only in fp16/bf16 (the bf16 optimizer's masters), whole. Stage 1 shards the
optimizer state and that copy (and, as measured, holds only its gradient partition once backward
has reduced it), 2 also gradients, 3 also parameters. ``offload_optimizer_device:
cpu`` moves optimizer state and fp32 copy to CPU memory, ``offload_param_device: cpu`` (ZeRO 3)
the parameter partitions. ZeRO 3 gathers one unit's parameters for compute, keeps parameters
below ``stage3_param_persistence_threshold`` elements whole, and allocates a reduce bucket of
``reduce_bucket_size`` elements up front — with DeepSpeed's defaults (a model that declares no
hidden size) 5e8 elements, 2 GB in fp32 on every rank whatever the model's size (measured).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchrig.plugin import MemoryComponent, MemoryEstimate, MemoryRequest, activation_component

from torchrig_deepspeed.constants import DEFAULT_ZERO_STAGE
from torchrig_deepspeed.ds_json import load_deepspeed_json
from torchrig_deepspeed.options import DeepSpeedPlugin

#: DeepSpeed's own defaults, used when neither the JSON nor the model's hidden size sets them.
DEFAULT_REDUCE_BUCKET = 500_000_000
DEFAULT_PERSISTENCE = 100_000


def _number(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _zero_block(options: DeepSpeedPlugin) -> Mapping[str, Any]:
    """The DeepSpeed JSON's ``zero_optimization`` block (inline, file or base64), or ``{}``."""
    if options.hf_ds_config is None:
        return {}
    block = load_deepspeed_json(options.hf_ds_config).data.get("zero_optimization")
    return block if isinstance(block, Mapping) else {}


def _zero_setting(zero: Mapping[str, Any], key: str, from_hidden: int | None, default: int) -> int:
    """A ``zero_optimization`` size from the DeepSpeed JSON, else ``auto``'s value from the
    model's hidden size (as torchrig fills it), else DeepSpeed's default."""
    value = _number(zero.get(key))
    if value is not None:
        return value
    return from_hidden if from_hidden is not None else default


def deepspeed_estimate(request: MemoryRequest) -> MemoryEstimate:
    model, world = request.model, max(request.world_size, 1)
    options = request.config.section_of(DeepSpeedPlugin)
    zero = _zero_block(options)
    # as the engine is built: zero_stage, else the JSON's stage, else Accelerate's default
    stage = options.zero_stage if options.zero_stage is not None else _number(zero.get("stage"))
    stage = DEFAULT_ZERO_STAGE if stage is None else stage
    half = request.precision in ("fp16", "bf16")
    width = request.compute_bytes if half else 4
    elements, trainable = model.numel, model.trainable_numel
    tensors = len(model.trainable)

    def part(count: int, sharded: bool) -> int:
        return -(-count // world) if sharded else count

    hidden = model.hidden_size
    persistence = _zero_setting(zero, "stage3_param_persistence_threshold", 10 * hidden if hidden else None,
                                DEFAULT_PERSISTENCE)
    persistent = sum(p.numel for p in model.parameters if p.numel < persistence) if stage == 3 else 0

    optimizer_where = "cpu" if options.offload_optimizer_device in ("cpu", "nvme") else "device"
    param_where = "cpu" if stage == 3 and options.offload_param_device in ("cpu", "nvme") else "device"
    shard = f"sharded over {world}"
    components = [
        MemoryComponent("parameters", (part(elements - persistent, stage >= 3) + persistent) * width
                        + model.buffer_bytes, param_where,
                        note=(f"{shard}; {persistent:,} elements below stage3_param_persistence_threshold "
                              "whole") if stage >= 3 else "whole"),
        MemoryComponent("gradients", part(trainable, stage >= 1) * width,
                        note=(shard if stage >= 2 else f"{shard} once reduced (DeepSpeed's ZeRO-1 frees the full "
                                                       "gradients after backward; measured)") if stage else "whole"),
        MemoryComponent("optimizer state", part(trainable, stage >= 1) * request.optimizer_bytes_per_element
                        + tensors * request.optimizer_bytes_per_tensor, optimizer_where,
                        note=shard if stage >= 1 else "whole"),
    ]
    if stage >= 1 or half:
        components.append(MemoryComponent("master weights (fp32)", part(trainable, stage >= 1) * 4, optimizer_where,
                                          note=shard if stage >= 1 else "whole"))
    if stage == 3:
        bucket = _zero_setting(zero, "reduce_bucket_size", hidden * hidden if hidden else None, DEFAULT_REDUCE_BUCKET)
        components.append(MemoryComponent("reduce bucket", bucket * width,
                                          note=f"reduce_bucket_size {bucket:,} elements, allocated up front"))
        if world > 1:
            components.append(MemoryComponent("all-gathered parameters", model.unit_parameters * width,
                                              note=f"{model.unit_name}, gathered for compute"))
    activations, notes = activation_component(request)
    notes = [*notes, "ZeRO-1/2 communication buckets (reduce_bucket_size, allgather_bucket_size) not counted"]
    return MemoryEstimate("deepspeed", f"deepspeed ZeRO-{stage}", world, request.precision,
                          tuple(components + activations), tuple(notes))


__all__ = ["deepspeed_estimate"]
