"""The norm of DTensor gradients sharded over several mesh dimensions, in one all-reduce.

Why: under FSDP2 x TP a gradient is sharded over ``dp_shard`` and ``tp`` at once. torch's
``get_total_norm`` makes each gradient's norm a DTensor partial on both axes and reduces them one
axis after the other — two collectives whose sums run in a different order on different rows of
the mesh, so ranks may disagree in the last bits (torch warns: "2 sequential all_reduce ...
flatten mesh dimensions"). Here the local shards' norm is computed first and reduced once, over a
1-D sub-mesh flattened from the sharded axes (created on first use and kept on the root mesh: a
collective, reached by every rank in the same order since every rank clips the same parameter
groups; a pipeline run, whose stages hold different groups, keeps torch's path). Replicated axes
need no reduction (every rank holds the same values); a gradient still partial on an axis is left
to torch's path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def dtensor_grad_norm(grads: Sequence[DTensor], norm_type: float, *, may_flatten: bool = True) -> torch.Tensor:
    """The ``norm_type`` norm of ``grads`` (DTensors of one mesh and one placement), equal on every
    rank, as a plain tensor. ``may_flatten``: whether a flattened sub-mesh may be created now."""
    mesh, placements = grads[0].device_mesh, grads[0].placements
    # every axis that is not replicated holds different values (Shard, and _StridedShard, which is no Shard)
    sharded = [dim for dim, placement in enumerate(placements) if not placement.is_replicate()]
    names = mesh.mesh_dim_names
    torch_path = (any(placement.is_partial() for placement in placements) or names is None
                  or (len(sharded) > 1 and not may_flatten))
    if torch_path:
        norm = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    local = torch.nn.utils.get_total_norm([grad.to_local() for grad in grads], norm_type=norm_type).float()
    if not sharded:
        return local
    group = (mesh.get_group(sharded[0]) if len(sharded) == 1
             else flattened(mesh, [names[dim] for dim in sharded]).get_group())
    if math.isinf(norm_type):
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        return local
    total = local.pow(norm_type)
    dist.all_reduce(total, group=group)
    return total.pow(1.0 / norm_type)


def flattened(mesh: Any, axes: list[str]) -> Any:
    """The 1-D sub-mesh over ``axes`` of ``mesh`` (named ``a_b``), created on first use."""
    name = "_".join(axes)
    root = mesh._get_root_mesh()
    existing = root._flatten_mapping.get(name)
    if existing is not None:
        return existing
    return mesh[tuple(axes)]._flatten(name)


__all__ = ["dtensor_grad_norm", "flattened"]
