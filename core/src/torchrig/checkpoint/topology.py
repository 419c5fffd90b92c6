"""The parallel layout a checkpoint was saved under, recorded in its manifest (``layout``).

Why: a checkpoint of a sharded strategy may be resumed under another device mesh (saved under
``dp_shard=2 x tp=2``, resumed under ``dp_shard=4``); the strategy reshards, and the log says so.
A strategy that cannot read the saved format refuses with both layouts named. The record is
what the strategy declared in its capabilities (the mesh's named axes and sizes, the
data-parallel size), never a strategy's name branched on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.host.run import RunContext


def current(run: RunContext) -> dict[str, Any]:
    """This run's layout: strategy, world size, data-parallel size and the mesh (axis -> size) if any."""
    capabilities = run.capabilities
    world = run.cluster.world_size
    mesh = getattr(capabilities, "device_mesh", None)
    axes = None
    if mesh is not None and getattr(mesh, "mesh_dim_names", None):
        axes = {str(name): int(size) for name, size in zip(mesh.mesh_dim_names, mesh.shape, strict=True)}
    data_parallel = getattr(capabilities, "data_parallel_size", None)
    return {"strategy": run.config.get("strategy"), "world_size": world, "mesh": axes,
            "data_parallel_size": int(data_parallel) if data_parallel is not None else world}


def saved(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The layout a manifest records; older manifests (no ``layout``) give what they have."""
    record = manifest.get("layout")
    if isinstance(record, Mapping):
        return dict(record)
    world = manifest.get("world_size", 1)
    return {"strategy": manifest.get("strategy"), "world_size": world, "mesh": None, "data_parallel_size": world}


def describe(record: Mapping[str, Any]) -> str:
    """``dp_shard=2 x tp=2`` for a mesh (its axes larger than 1), else ``<strategy> on N process(es)``."""
    mesh = record.get("mesh")
    if isinstance(mesh, Mapping):
        axes = [f"{name}={size}" for name, size in mesh.items() if isinstance(size, int) and size > 1]
        if axes:
            return " x ".join(axes)
    world = record.get("world_size", 1)
    return f"{record.get('strategy') or 'single'} on {world} process{'es' if world != 1 else ''}"


def changed(before: Mapping[str, Any], after: Mapping[str, Any]) -> bool:
    """Whether the model is laid out differently: another mesh, world size or strategy."""
    return describe(before) != describe(after)


__all__ = ["changed", "current", "describe", "saved"]
