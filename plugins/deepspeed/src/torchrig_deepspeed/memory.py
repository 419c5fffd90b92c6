"""DeepSpeed ZeRO's per-rank memory (torch-free: estimating never imports deepspeed).

Parameters and gradients are in the compute dtype (the engine casts the module to fp16/bf16).
ZeRO 1 and 2 keep a flat fp32 copy of this rank's partition for the optimizer (even in fp32
training: ``single_partition_of_fp32_groups``), ZeRO 3 likewise (``fp32_partitioned_groups_flat``);
stage 0 keeps one only in fp16/bf16 (the bf16 optimizer's masters), whole. Stage 1 shards the
optimizer state and that copy, 2 also gradients, 3 also parameters. ``offload_optimizer_device:
cpu`` moves optimizer state and fp32 copy to CPU memory, ``offload_param_device: cpu`` (ZeRO 3)
the parameter partitions. ZeRO 3 gathers one unit's parameters for compute.
"""

from __future__ import annotations

from torchrig.memory import MemoryComponent, MemoryEstimate, MemoryRequest, activation_component

SECTION = "deepspeed_config"


def deepspeed_estimate(request: MemoryRequest) -> MemoryEstimate:
    model, world = request.model, max(request.world_size, 1)
    stage = request.config.get(f"{SECTION}.zero_stage")
    stage = 2 if stage is None else int(stage)  # DeepSpeedPlugin's default when the JSON says "auto"
    half = request.precision in ("fp16", "bf16")
    width = request.compute_bytes if half else 4
    elements, trainable = model.numel, model.trainable_numel
    tensors = len(model.trainable)

    def part(count: int, sharded: bool) -> int:
        return -(-count // world) if sharded else count

    optimizer_where = "cpu" if request.config.get(f"{SECTION}.offload_optimizer_device") in ("cpu", "nvme") else "device"
    param_where = "cpu" if stage == 3 and request.config.get(f"{SECTION}.offload_param_device") in ("cpu", "nvme") else "device"
    shard = f"sharded over {world}"
    components = [
        MemoryComponent("parameters", part(elements, stage >= 3) * width + model.buffer_bytes, param_where,
                        note=shard if stage >= 3 else "whole"),
        MemoryComponent("gradients", part(trainable, stage >= 2) * width, note=shard if stage >= 2 else "whole"),
        MemoryComponent("optimizer state", part(trainable, stage >= 1) * request.optimizer_bytes_per_element
                        + tensors * request.optimizer_bytes_per_tensor, optimizer_where,
                        note=shard if stage >= 1 else "whole"),
    ]
    if stage >= 1 or half:
        components.append(MemoryComponent("master weights (fp32)", part(trainable, stage >= 1) * 4, optimizer_where,
                                          note=shard if stage >= 1 else "whole"))
    if stage == 3 and world > 1:
        components.append(MemoryComponent("all-gathered parameters", model.unit_parameters * width,
                                          note=f"{model.unit_name}, gathered for compute"))
    activations, notes = activation_component(request)
    notes = [*notes, "communication buckets (reduce_bucket_size, allgather_bucket_size) not counted"]
    return MemoryEstimate("deepspeed", f"deepspeed ZeRO-{stage}", world, request.precision,
                          tuple(components + activations), tuple(notes))


__all__ = ["deepspeed_estimate"]
