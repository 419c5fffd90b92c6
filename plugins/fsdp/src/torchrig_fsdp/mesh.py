"""The N-D device mesh of the ``fsdp`` strategy from ``parallelism_config``, and tensor parallelism on it.

Order (as torchtitan): tensor parallel first (``parallelize_module`` over the ``tp`` sub-mesh, or the
user's ``parallelize_fn(model, mesh)``), then ``fully_shard`` over the data mesh — ``dp_shard``, or
``("dp_replicate", "dp_shard")`` for HSDP; ``dp_shard_cp`` in place of ``dp_shard`` with a ``cp`` axis
(:mod:`torchrig_fsdp.submeshes`). FSDP2-only runs keep the 1-D/2-D mesh ``sharding_strategy``
asks for (:func:`torchrig_fsdp.strategy.mesh_shape`). docs/parallelism.md.
"""

from __future__ import annotations

import fnmatch
import functools
from typing import Any

import torch
from torchrig.config.options import ParallelismConfig
from torchrig.config.parallelism import infer_sizes, key_of
from torchrig.errors import ConfigError
from torchrig.run import RunContext

from torchrig_fsdp import submeshes

#: Mesh axes the strategy builds, outermost first (docs/parallelism.md: why this order).
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DATA_AXES = ("dp_replicate", "dp_shard")


def parallelism(run: RunContext) -> ParallelismConfig:
    return run.section(ParallelismConfig)


def mesh_layout(config: ParallelismConfig, world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Shape and names of the mesh for ``config`` at ``world_size``: ``dp_shard`` always (the axis
    FSDP2 shards over, size 1 when unused), ``pp``, ``dp_replicate``, ``cp`` and ``tp`` when larger than 1.
    Raises :class:`ConfigError` naming the keys when the sizes do not fit the world."""
    sizes, problems = infer_sizes(config.sizes, world_size)
    if problems:
        raise ConfigError([f"{key_of(axis)}: {message}" for axis, message in problems])
    names = tuple(axis for axis in AXES if axis == "dp_shard" or sizes[axis] > 1)
    return tuple(sizes[axis] for axis in names), names


def data_mesh(mesh: Any) -> Any:
    """The sub-mesh ``fully_shard`` shards over (2-D: HSDP, replicate across, shard within; with a
    ``cp`` axis ``dp_shard_cp``), or None when there is nothing to shard over (tensor parallel alone)."""
    return submeshes.shard_mesh(mesh)


def data_parallel_layout(mesh: Any) -> tuple[int, int]:
    """(size, rank) of data parallelism: the ranks of one ``tp``/``cp`` group (and of one pipeline) get the same batches."""
    if mesh is None:
        return 1, 0
    size, index = 1, 0
    for name in DATA_AXES:
        if name in (mesh.mesh_dim_names or ()):
            axis = mesh[name]
            size, index = size * axis.size(), index * axis.size() + axis.get_local_rank()
    return size, index


def data_parallel_group(mesh: Any, named: dict[str, Any]) -> Any:
    """The process group of this rank's data-parallel peers (same ``pp``, ``tp`` and ``cp`` coordinates), or
    None when every rank is a data-parallel rank (the mesh has data axes only). ``named``:
    :func:`torchrig_fsdp.submeshes.named_meshes` of ``mesh``."""
    if all(name in DATA_AXES for name in mesh.mesh_dim_names or ()):
        return None
    return named["dp"].get_group()


def pp_mesh(mesh: Any) -> Any:
    return mesh["pp"] if mesh is not None and "pp" in (mesh.mesh_dim_names or ()) else None


def tp_mesh(mesh: Any) -> Any:
    return mesh["tp"] if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) else None


# -- tensor parallel ------------------------------------------------------------------------------


def _styles(loss_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out = Shard(-1) if loss_parallel else Replicate()
    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "embedding": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=out, use_local_output=not loss_parallel),
        "sequence_parallel": SequenceParallel(),
        "prepare_input_sp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "rowwise_sp": RowwiseParallel(output_layouts=Shard(1)),
        "embedding_sp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "output_sp": ColwiseParallel(input_layouts=Shard(1), output_layouts=out, use_local_output=not loss_parallel),
    }


def model_plan(model: torch.nn.Module) -> dict[str, Any] | None:
    """A plan the model declares itself (transformers: ``_tp_plan``, or ``base_model_tp_plan`` in its
    config), its patterns made relative to ``model``: a plan found on a submodule gets the
    submodule's name in front, a config's ``base_model_tp_plan`` the base model's
    (``base_model_prefix``)."""
    for name, module in model.named_modules():
        for attribute in ("_tp_plan", "base_model_tp_plan"):
            owner, plan = name, getattr(module, attribute, None)
            if not plan:
                plan = getattr(getattr(module, "config", None), attribute, None)
                base = getattr(module, "base_model_prefix", "")
                if attribute == "base_model_tp_plan" and base and isinstance(getattr(module, base, None), torch.nn.Module):
                    owner = f"{name}.{base}" if name else base
            if isinstance(plan, dict) and plan:
                return {(f"{owner}.{key}" if owner else key): style for key, style in plan.items()}
    return None


def resolve_plan(model: torch.nn.Module, plan: dict[str, Any], loss_parallel: bool, where: str,
                 require_match: bool = True) -> dict[str, Any]:
    """Module-name globs -> ``{module name: ParallelStyle}``; every pattern must match a module
    (unless ``require_match`` is False: a pipeline stage, the plan being checked on the whole model
    first) and every style name must be known (errors name ``where`` and list what exists)."""
    styles = _styles(loss_parallel)
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, Any] = {}
    problems = []
    for pattern, style in plan.items():
        if style is None:
            continue
        if style not in styles:
            problems.append(f"{where}: {pattern!r}: unknown style {style!r}; styles: {', '.join(styles)}")
            continue
        matched = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matched and require_match:
            sample = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            problems.append(f"{where}: {pattern!r} matches no module of {type(model).__name__} (modules: {sample})")
        for name in matched:
            resolved[name] = styles[style]
    if problems:
        raise ConfigError(problems)
    return resolved


def apply_tensor_parallel(run: RunContext, model: torch.nn.Module, mesh: Any, parallelize_fn: Any,
                          require_match: bool = True) -> None:
    """``parallelize_fn(model, mesh)`` when given (it receives the whole mesh), else the plan:
    ``parallelism_config.tp_plan`` or the model's own, applied over the ``tp`` sub-mesh."""
    config = parallelism(run)
    if parallelize_fn is not None:
        parallelize_fn(model, mesh)
        return
    tp = tp_mesh(mesh)
    if tp is None:
        return
    plan, where = config.tp_plan, "parallelism_config.tp_plan"
    if plan is None:
        plan, where = model_plan(model), f"{type(model).__name__}'s own tensor-parallel plan"
    if not plan:
        raise ConfigError([f"parallelism_config.tp_plan: tp_size is {tp.size()} but no plan says which modules to "
                           f"split and {type(model).__name__} declares none (base_model_tp_plan); set tp_plan "
                           "(module-name glob -> style) or pass FullyShardedDataParallelPlugin(parallelize_fn=...)"])
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp, resolve_plan(model, plan, config.loss_parallel, where, require_match))


def wrap_loss_parallel(model: torch.nn.Module) -> None:
    """``loss_parallel``: the forward (which computes the loss on the sharded logits) runs in torch's
    ``loss_parallel`` context; the backward slot enters it too (:func:`loss_parallel_backward`)."""
    from torch.distributed.tensor.parallel import loss_parallel

    forward = model.forward

    @functools.wraps(forward)
    def sharded_loss_forward(*args: Any, **kwargs: Any) -> Any:
        with loss_parallel():
            return forward(*args, **kwargs)

    model.forward = sharded_loss_forward


def loss_parallel_backward(backward: Any) -> Any:
    from torch.distributed.tensor.parallel import loss_parallel

    def backward_in_loss_parallel(loss: Any, **kwargs: Any) -> None:
        with loss_parallel():
            backward(loss, **kwargs)

    return backward_in_loss_parallel


__all__ = ["AXES", "DATA_AXES", "apply_tensor_parallel", "data_mesh", "data_parallel_group", "data_parallel_layout",
           "loss_parallel_backward", "mesh_layout", "model_plan", "parallelism", "pp_mesh", "resolve_plan", "tp_mesh",
           "wrap_loss_parallel"]
