"""FSDP2's per-rank memory (torch-free arithmetic on :mod:`torchrig.estimate.memory`).

Each parameter is sharded on dim 0 over the world (padded to ``ceil(dim0 / W)`` rows), and so are
its gradient and its optimizer state; sharded parameters stay in their own dtype (fp32: they are
the master weights; ``MixedPrecisionPolicy`` casts only the all-gathered copy). At the peak of
backward one unit is all-gathered in the compute dtype together with its unsharded gradient;
with ``reshard_after_forward`` off every unit stays gathered from forward to backward.
"""

from __future__ import annotations

from torchrig.plugin import (
    MemoryComponent,
    MemoryEstimate,
    MemoryRequest,
    activation_component,
    optimizer_bytes,
    sharded_elements,
)

from torchrig_fsdp.options import FullyShardedDataParallelPlugin


def fsdp_estimate(request: MemoryRequest) -> MemoryEstimate:
    model, world = request.model, request.world_size
    trainable = model.trainable
    shard_bytes = sum(p.shard_numel(world) * p.nbytes // max(p.numel, 1) for p in model.parameters)
    grad_bytes = sum(p.shard_numel(world) * p.nbytes // max(p.numel, 1) for p in trainable)
    compute = request.compute_bytes
    options = request.config.section_of(FullyShardedDataParallelPlugin)
    reshard = options.resolved_reshard_after_forward
    gathered = model.unit_parameters if reshard else model.numel
    components = [
        MemoryComponent("parameters", shard_bytes + model.buffer_bytes, note=f"sharded over {world} (dim 0, padded)"),
        MemoryComponent("gradients", grad_bytes, note=f"sharded over {world}"),
        MemoryComponent("optimizer state", optimizer_bytes(request, sharded_elements(trainable, world), len(trainable)),
                        note=f"sharded over {world}"),
    ]
    notes = []
    if world > 1:
        what = model.unit_name if reshard else "every unit (reshard_after_forward off)"
        components.append(MemoryComponent("all-gathered parameters", gathered * compute,
                                          note=f"{what}, {compute}-byte compute dtype"))
        components.append(MemoryComponent("unsharded gradients", model.unit_parameters * compute,
                                          note="one unit's gradient before its reduce-scatter"))
    activations, act_notes = activation_component(request)
    if options.activation_checkpointing and activations:
        act_notes.append("activation_checkpointing is on: activations are an upper bound (only block inputs are kept)")
    if request.precision != "no":
        notes.append(f"{request.precision}: sharded parameters stay fp32 (the master weights); "
                     "only gathered copies are in the compute dtype")
    return MemoryEstimate("fsdp", f"fsdp (FSDP2, {'reshard' if reshard else 'no reshard'} after forward)", world,
                          request.precision, tuple(components + activations), tuple(notes + act_notes))


__all__ = ["fsdp_estimate"]
