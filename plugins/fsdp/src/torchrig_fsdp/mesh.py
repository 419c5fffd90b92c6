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

import attrs
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torchrig.plugin import (
    ConfigError,
    CoreOptions,
    ParallelismConfig,
    RunContext,
    infer_parallelism_sizes,
    parallelism_key,
)

from torchrig_fsdp import hf_styles, submeshes, tp_styles

#: Mesh axes the strategy builds, outermost first (docs/parallelism.md: why this order).
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DATA_AXES = ("dp_replicate", "dp_shard")


def parallelism(run: RunContext) -> ParallelismConfig:
    """The run's ``parallelism_config``, its ``elastic_axis`` set to the axis this round re-derives
    from its world size (None when the world is fixed): :meth:`ParallelismConfig.elastic_axis_for`."""
    config = run.section(ParallelismConfig)
    axis = config.elastic_axis_for(run.section(CoreOptions))
    return config if axis == config.elastic_axis else attrs.evolve(config, elastic_axis=axis)


def mesh_layout(config: ParallelismConfig, world_size: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Shape and names of the mesh for ``config`` at ``world_size``: ``dp_shard`` always (the axis
    FSDP2 shards over, size 1 when unused), ``pp``, ``dp_replicate``, ``cp`` and ``tp`` when larger than 1.
    Raises :class:`ConfigError` naming the keys when the sizes do not fit the world."""
    sizes, problems = infer_parallelism_sizes(config.sizes, world_size, elastic_axis=config.elastic_axis,
                                              ep_size=config.ep_size)
    if problems:
        raise ConfigError([f"{parallelism_key(axis)}: {message}" for axis, message in problems])
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


def torchrig_styles(loss_parallel: bool) -> dict[str, ParallelStyle]:
    """torchrig's own style names (docs/parallelism.md), the vocabulary of ``parallelism_config.tp_plan``."""
    return {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "embedding": RowwiseParallel(input_layouts=Replicate()),
        # loss parallel: the logits stay sharded; else gathered whole as a fresh tensor, not a view (FSDP2 warns)
        "output": (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if loss_parallel
                   else tp_styles.colwise_gather_output()),
        "sequence_parallel": SequenceParallel(),
        "prepare_input_sp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "rowwise_sp": RowwiseParallel(output_layouts=Shard(1)),
        "embedding_sp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "output_sp": (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
                      if loss_parallel
                      else tp_styles.colwise_gather_output(input_layouts=Shard(1))),
    }


def declared_plan(model: torch.nn.Module, attributes: tuple[str, str]) -> dict[str, Any] | None:
    """A plan the model declares itself under ``attributes`` (transformers: ``("_tp_plan",
    "base_model_tp_plan")``, the module's own and its config's base-model one), its patterns made relative
    to ``model``: a plan found on a submodule gets the submodule's name in front, a config's base-model
    plan the base model's (``base_model_prefix``)."""
    own_attribute, base_attribute = attributes
    for name, module in model.named_modules():
        for attribute in (own_attribute, base_attribute):
            owner, plan = name, getattr(module, attribute, None)
            if not plan:
                plan = getattr(getattr(module, "config", None), attribute, None)
                base = getattr(module, "base_model_prefix", "")
                if attribute == base_attribute and base and isinstance(getattr(module, base, None), torch.nn.Module):
                    owner = f"{name}.{base}" if name else base
            if isinstance(plan, dict) and plan:
                return {(f"{owner}.{key}" if owner else key): style for key, style in plan.items()}
    return None


def model_plan(model: torch.nn.Module) -> dict[str, Any] | None:
    """The tensor-parallel plan the model declares (``_tp_plan`` / ``base_model_tp_plan``): :func:`declared_plan`."""
    return declared_plan(model, ("_tp_plan", "base_model_tp_plan"))


def matches_by_segment(name: str, pattern: str) -> bool:
    """transformers' matching: ``*`` stands for one dotted segment (a layer number), never for several."""
    names, patterns = name.split("."), pattern.split(".")
    return len(names) == len(patterns) and all(map(fnmatch.fnmatchcase, names, patterns))


def resolve_plan(model: torch.nn.Module, plan: dict[str, Any], loss_parallel: bool, where: str,
                 require_match: bool = True, own: bool = False) -> dict[str, Any]:
    """Module- (or parameter-) name globs -> ``{module name: ParallelStyle}``.

    ``plan`` is the user's ``tp_plan`` (torchrig's style names or transformers', ``fnmatch`` globs: every
    pattern must match a module unless ``require_match`` is False — a pipeline stage, the plan being checked
    on the whole model first) or, ``own``, the model's own (transformers' names,
    :data:`torchrig_fsdp.hf_styles.TRANSFORMERS_STYLES`; ``*`` is one segment; an entry for a module
    variant this config does not build matches nothing and is skipped, as transformers skips it —
    but some entry must match). An entry naming a parameter (transformers' expert weights) shards that
    parameter; its module's own entry must run on local shards. Unknown and refused styles are errors
    naming ``where``, the pattern, and what to do."""
    styles = torchrig_styles(loss_parallel)
    table = hf_styles.TRANSFORMERS_STYLES  # a user's plan may be copied from a model's own (manifest: tp_styles)
    matches = matches_by_segment if own else fnmatch.fnmatchcase
    modules = dict(model.named_modules())
    names = [name for name in modules if name]
    parameter_names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    module_styles: dict[str, Any] = {}
    parameter_rules: dict[str, dict[str, Any]] = {}
    problems, matched_any = [], False
    for pattern, style in plan.items():
        if style is None:
            continue
        entry = table.get(style)
        if entry is not None and entry.refused:
            problems.append(f"{where}: {pattern!r}: style {style!r} is refused: {entry.refused}")
            continue
        if entry is not None and entry.gathers_output and loss_parallel:
            problems.append(f"parallelism_config.loss_parallel: {where}: {pattern!r} is {style!r}, which gathers the "
                            "output whole; loss parallel needs it split: give parallelism_config.tp_plan with "
                            f"{pattern!r}: 'output', or set loss_parallel false")
            continue
        if style not in styles and entry is None:
            known = ", ".join(dict.fromkeys([*styles, *table]))
            problems.append(f"{where}: {pattern!r}: unknown style {style!r}; styles: {known}")
            continue
        matched = [name for name in names if matches(name, pattern)]
        params = [name for name in parameter_names if matches(name, pattern)] if own else []
        matched_any = matched_any or bool(matched or params)
        if not matched and not params and require_match and not own:
            sample = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            problems.append(f"{where}: {pattern!r} matches no module of {type(model).__name__} (modules: {sample})")
        for name in matched:
            if entry is not None and entry.module is None:
                problems.append(f"{where}: {pattern!r}: style {style!r} applies to parameters, and {name!r} is a module")
                continue
            module_styles[name] = styles[style] if style in styles else entry.module()
        for name in params:
            owner, _, attribute = name.rpartition(".")
            if entry is None or entry.parameter is None:
                problems.append(f"{where}: {pattern!r}: style {style!r} applies to modules, and {name!r} is a parameter")
                continue
            parameter_rules.setdefault(owner, {})[attribute] = entry.parameter
    if own and not matched_any and not problems:
        problems.append(f"{where}: no entry matches a module of {type(model).__name__}; give parallelism_config.tp_plan")
    for owner, rules in parameter_rules.items():
        then = module_styles.get(owner)
        if not isinstance(then, tp_styles.LOCAL_FORWARD_STYLES):
            problems.append(f"{where}: parameters {', '.join(f'{owner}.{a}' for a in rules)} are sharded by their "
                            f"own entries but module {owner!r} has no style that runs its forward on local shards "
                            "(moe_tp_experts, local_params, packed_colwise); add one for it")
            continue
        module_styles[owner] = tp_styles.ShardedParameters(rules, then)
    if problems:
        raise ConfigError(problems)
    return module_styles


def _tied_parameters(model: torch.nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of (module name, attribute) that hold one and the same parameter (tied embeddings)."""
    holders: dict[int, list[tuple[str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attribute, param in module._parameters.items():
            if param is not None and (module_name, attribute) not in holders.get(id(param), []):
                holders.setdefault(id(param), []).append((module_name, attribute))
    return [group for group in holders.values() if len(group) > 1]


def _retie(model: torch.nn.Module, groups: list[list[tuple[str, str]]], where: str) -> None:
    """Make each tied group one parameter again after ``parallelize_module`` replaced some of its
    holders' parameters: the same DTensor when every holder was sharded the same way, else an error
    naming the parameters and the fix (checked on every rank identically, before training)."""
    problems = []
    for group in groups:
        params = [model.get_submodule(name)._parameters[attribute] for name, attribute in group]
        labels = [f"{name}.{attribute}" if name else attribute for name, attribute in group]
        layouts = {tuple(p.placements) if isinstance(p, DTensor) else None for p in params}
        if len(layouts) > 1:
            shown = ", ".join(f"{label}: {tuple(p.placements) if isinstance(p, DTensor) else 'whole'}"
                              for label, p in zip(labels, params, strict=True))
            problems.append(f"{where}: {' and '.join(labels)} are one tied parameter (tie_word_embeddings) but the plan "
                            f"splits them differently ({shown}); untie them (tie_word_embeddings=False) or give "
                            "parallelism_config.tp_plan with the same split for both (embedding + output)")
            continue
        for name, attribute in group[1:]:
            model.get_submodule(name)._parameters[attribute] = params[0]
    if problems:
        raise ConfigError(problems)


def apply_tensor_parallel(run: RunContext, model: torch.nn.Module, mesh: Any, parallelize_fn: Any,
                          require_match: bool = True) -> None:
    """``parallelize_fn(model, mesh)`` when given (it receives the whole mesh), else the plan:
    ``parallelism_config.tp_plan`` or the model's own, applied over the ``tp`` sub-mesh — head counts
    checked first, tied parameters tied again after."""
    config = parallelism(run)
    if parallelize_fn is not None:
        parallelize_fn(model, mesh)
        return
    tp = tp_mesh(mesh)
    if tp is None:
        return
    plan, where, own = config.tp_plan, "parallelism_config.tp_plan", False
    if plan is None:
        plan, where, own = model_plan(model), f"{type(model).__name__}'s own tensor-parallel plan", True
    if not plan:
        raise ConfigError([f"parallelism_config.tp_plan: tp_size is {tp.size()} but no plan says which modules to "
                           f"split and {type(model).__name__} declares none (base_model_tp_plan); set tp_plan "
                           "(module-name glob -> style) or pass FullyShardedDataParallelPlugin(parallelize_fn=...)"])
    resolved = resolve_plan(model, plan, config.loss_parallel, where, require_match, own=own)
    problems = hf_styles.check_heads_divide(model, list(resolved), tp.size())
    if problems:
        raise ConfigError(problems)
    tied = _tied_parameters(model)
    parallelize_module(model, tp, resolved)
    _retie(model, tied, where)


def wrap_loss_parallel(model: torch.nn.Module) -> None:
    """``loss_parallel``: the forward (which computes the loss on the sharded logits) runs in torch's
    ``loss_parallel`` context; the backward slot enters it too (:func:`loss_parallel_backward`)."""
    forward = model.forward

    @functools.wraps(forward)
    def sharded_loss_forward(*args: Any, **kwargs: Any) -> Any:
        with loss_parallel():
            return forward(*args, **kwargs)

    model.forward = sharded_loss_forward


def loss_parallel_backward(backward: Any) -> Any:
    def backward_in_loss_parallel(loss: Any, **kwargs: Any) -> None:
        with loss_parallel():
            backward(loss, **kwargs)

    return backward_in_loss_parallel


__all__ = ["AXES", "DATA_AXES", "apply_tensor_parallel", "data_mesh", "declared_plan", "data_parallel_group", "data_parallel_layout",
           "loss_parallel_backward", "matches_by_segment", "mesh_layout", "model_plan", "parallelism", "pp_mesh", "resolve_plan",
           "torchrig_styles", "tp_mesh", "wrap_loss_parallel"]
