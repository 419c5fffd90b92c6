"""Named sub-meshes of the run's mesh, as torchtitan names them: ``dp`` (every data-parallel rank),
``dp_shard_cp`` (what FSDP2 shards over when there is a ``cp`` axis), ``dp_cp`` (the ranks a loss
is averaged over), plus each axis of the mesh itself.

Why a module of their own: torch deprecates slicing a flattened dimension from the root mesh
(``mesh["dp"]`` warns since 2.11); the flattened meshes are built once (a collective: they create
process groups), kept, and handed to the accelerator (``accelerator.device_submeshes``).
"""

from __future__ import annotations

import warnings
from typing import Any

#: Flattened sub-meshes, each from the axes of the mesh it spans that the mesh has (torchtitan's names).
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


def named_meshes(mesh: Any) -> dict[str, Any]:
    """``{name: DeviceMesh}``: every axis of ``mesh``, then each flattened sub-mesh of
    :data:`FLATTENED` whose axes the mesh has (one present axis is flattened too, so the name is
    always the sub-mesh's ``mesh_dim_names``). Collective: call on every rank, in the same order."""
    names = tuple(mesh.mesh_dim_names or ())
    result = {name: mesh[name] for name in names}
    for flat, parts in FLATTENED.items():
        present = tuple(part for part in parts if part in names)
        if present:
            result[flat] = mesh[present]._flatten(flat) if len(present) > 1 else mesh[present[0]]._flatten(flat)
    return result


def shard_mesh(mesh: Any) -> Any:
    """The mesh ``fully_shard`` shards over: ``dp_shard`` (``dp_shard_cp`` with a ``cp`` axis: the cp
    ranks of a replica hold different tokens of the same batch, so their gradients are reduced
    together), 2-D with ``dp_replicate`` in front for HSDP; None when every such axis has size 1
    (tensor parallel alone). :func:`named_meshes` must have run (it registers the flattened axes)."""
    names = tuple(mesh.mesh_dim_names or ())
    shard = "dp_shard_cp" if "cp" in names else "dp_shard"
    shard_size = _flat_size(mesh, shard)
    if "dp_replicate" not in names:
        return None if shard_size == 1 else _slice(mesh, shard)
    if mesh["dp_replicate"].size() == 1 and shard_size == 1:
        return None
    return _slice(mesh, ("dp_replicate", shard))


def _flat_size(mesh: Any, flat: str) -> int:
    size = 1
    for part in FLATTENED.get(flat, (flat,)):
        if part in (mesh.mesh_dim_names or ()):
            size *= mesh[part].size()
    return size


def _slice(mesh: Any, axes: Any) -> Any:
    """``mesh[axes]`` where ``axes`` may name a flattened axis: torch's deprecation warning for
    that is about bookkeeping (done here), and HSDP needs the 2-D (replicate, flattened) slice."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
        return mesh[axes]


__all__ = ["FLATTENED", "named_meshes", "shard_mesh"]
