"""Which submodules get their own ``fully_shard`` (``auto_wrap_policy``: Hugging Face's
``_no_split_modules``, named classes, torch's size-based rule, or an FSDP1-style callable; their activation
checkpointing is in :mod:`torchrig_fsdp.activation_checkpointing`), and the tensor-parallel plan of a model
wrapped by LoRA adapters (peft renames the layers a plan names, so the plan must follow them: :func:`adapter_tp_plan`)."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torchrig.plugin import ConfigError, ConfigLayer, RunContext

from torchrig_fsdp import hf_styles
from torchrig_fsdp import mesh as mesh_module
from torchrig_fsdp.constants import SECTION
from torchrig_fsdp.explain import FSDPConfigError, noted
from torchrig_fsdp.mesh import model_plan, torchrig_styles
from torchrig_fsdp.options import FullyShardedDataParallelPlugin


def written_by_operator(run: RunContext, key: str) -> str | None:
    """Where ``key`` was set when a machine default file, a config file, an environment variable
    or a flag set it (an explicit choice for this run); None for defaults and ``Accelerator(...)``
    arguments (an options object carries every field, chosen or not)."""
    where = run.option_source(key)
    return None if where is None or where.layer in (ConfigLayer.DEFAULT, ConfigLayer.ARGUMENT) else str(where)


def wrap_blocks(model: torch.nn.Module, options: FullyShardedDataParallelPlugin, run: RunContext | None = None) -> list[torch.nn.Module]:
    """The submodules that get their own ``fully_shard`` (besides the root), children before
    their parents, following ``auto_wrap_policy``."""
    policy = options.auto_wrap_policy
    ignored = {id(m) for m in as_modules(options.ignored_modules)}
    candidates = [m for m in _post_order(model) if m is not model and id(m) not in ignored]
    if policy in (None, "NO_WRAP"):
        return []
    if callable(policy):  # FSDP1's protocol: policy(module, recurse, nonwrapped_numel) -> bool
        return [m for m in candidates if policy(module=m, recurse=False, nonwrapped_numel=_numel(m))]
    if policy == "SIZE_BASED_WRAP":
        return _size_based(model, options.min_num_params, ignored)
    names = options.transformer_layer_cls_to_wrap
    key = f"{SECTION}.transformer_layer_cls_to_wrap"
    if not names:
        names = _no_split_modules(model)
        if not names:
            chosen = written_by_operator(run, f"{SECTION}.auto_wrap_policy") if run is not None else "the options"
            if chosen is None:
                noted.info("fsdp.root-only", (
                    f"fsdp: {type(model).__name__} declares no _no_split_modules and {key} is not set: only the root "
                    "module is sharded (one all-gather for the whole model). Set transformer_layer_cls_to_wrap or "
                    "auto_wrap_policy: SIZE_BASED_WRAP to shard blocks separately."))
                return []
            raise FSDPConfigError(
                f"{key}: auto_wrap_policy is TRANSFORMER_BASED_WRAP ({chosen}) but no classes are given and "
                f"{type(model).__name__} declares no _no_split_modules; set {key} (e.g. --fsdp_transformer_layer_cls_to_wrap "
                "MyBlock), or choose auto_wrap_policy SIZE_BASED_WRAP or NO_WRAP")
    present = {type(m).__name__ for m in candidates}
    missing = [name for name in names if name not in present]
    if missing:
        raise FSDPConfigError(
            f"{key}: no module of class {', '.join(repr(n) for n in missing)} in {type(model).__name__}; its submodule "
            f"classes are: {', '.join(sorted(present)) or '(none)'}")
    wanted = set(names)
    return [m for m in candidates if type(m).__name__ in wanted]


def _post_order(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _size_based(model: torch.nn.Module, min_num_params: int, ignored: set[int]) -> list[torch.nn.Module]:
    """torch's ``size_based_auto_wrap_policy``: bottom-up, a submodule whose parameters not yet in a
    wrapped child reach ``min_num_params`` gets its own ``fully_shard``. 0 means the root only."""
    if min_num_params <= 0:
        return []
    blocks: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> int:
        remaining = sum(p.numel() for p in module.parameters(recurse=False))
        for child in module.children():
            if id(child) not in ignored:
                remaining += visit(child)
        if module is not model and remaining >= min_num_params:
            blocks.append(module)
            return 0
        return remaining

    visit(model)
    return blocks


def _no_split_modules(model: torch.nn.Module) -> list[str]:
    """Hugging Face models name their repeated blocks in ``_no_split_modules`` (on the model or on
    a submodule, e.g. the base model inside a task head)."""
    names: list[str] = []
    for module in model.modules():
        for name in getattr(module, "_no_split_modules", None) or ():
            if name not in names:
                names.append(name)
    return names


def as_modules(value: Any) -> list[torch.nn.Module]:
    if value is None:
        return []
    if isinstance(value, torch.nn.Module):
        return [value]
    return [m for m in value if isinstance(m, torch.nn.Module)]


def _lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """peft's LoRA layers by name, recognised by their shape (a ``base_layer`` and ``lora_A``/``lora_B``
    module dicts), so the plugin needs no peft import."""
    return {name: module for name, module in model.named_modules()
            if isinstance(getattr(module, "base_layer", None), torch.nn.Module)
            and isinstance(getattr(module, "lora_A", None), torch.nn.ModuleDict)
            and isinstance(getattr(module, "lora_B", None), torch.nn.ModuleDict)}


def _declares_plan(module: torch.nn.Module) -> bool:
    """The module holds a plan itself (transformers' ``_tp_plan`` or its config's ``base_model_tp_plan``), not
    through a wrapper's attribute forwarding (peft's ``PeftModel`` answers its base model's attributes)."""
    own = vars(module)
    config = own.get("config")
    return (any("_tp_plan" in vars(k) for k in type(module).__mro__) or "_tp_plan" in own
            or bool(getattr(config, "base_model_tp_plan", None)))


def _plan_owner(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """The outermost module that declares a plan itself, and its name."""
    return next(((name, module) for name, module in model.named_modules() if _declares_plan(module)), None)


def _split_side(style: Any) -> str | None:
    """``"output"`` for a column-wise style (output features split), ``"input"`` for a row-wise one."""
    own = torchrig_styles(loss_parallel=False)
    entry = hf_styles.TRANSFORMERS_STYLES.get(style)
    if style in own:
        style = own[style]
    elif entry is not None and entry.module is not None:
        style = entry.module()
    if isinstance(style, ColwiseParallel):
        return "output"
    if isinstance(style, RowwiseParallel):
        return "input"
    return None


def _segments_match(name: str, pattern: str) -> bool:
    names, patterns = name.split("."), pattern.split(".")
    return len(names) == len(patterns) and all(map(fnmatch.fnmatchcase, names, patterns))


def adapter_tp_plan(model: torch.nn.Module, plan: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The tensor-parallel plan for a model with LoRA adapters (peft), or ``plan`` unchanged without any.

    peft wraps the model (``base_model.model.`` in front of every name) and replaces each adapted layer
    by a LoRA layer holding the original as ``base_layer``: the model's own plan (found on the wrapped
    model when ``plan`` is None) matches nothing any more, and a column-/row-wise style cannot split a
    LoRA layer. Each entry is made relative to the wrapper, and an entry matching LoRA layers becomes
    exact entries: the original layer under its style, the adapter on the split side under the same
    style (column-wise: ``lora_B`` produces the local output columns; row-wise: ``lora_A`` reads the
    local input columns and its output is summed), the other adapter whole on every rank. A LoRA layer
    under any other style (an embedding, a packed projection) is refused naming it."""
    layers = _lora_layers(model)
    owner = _plan_owner(model)
    if not layers or owner is None:
        return plan
    base = f"{owner[0]}." if owner[0] else ""
    if plan is None:
        plan = {base + key: style for key, style in (model_plan(owner[1]) or {}).items()}
    modules = [name for name, _ in model.named_modules() if name]
    rewritten: dict[str, Any] = {}
    problems = []
    for pattern, style in plan.items():
        full = next((prefix + pattern for prefix in ("", base) if any(_segments_match(n, prefix + pattern) for n in modules)),
                    pattern)
        matched = [name for name in modules if _segments_match(name, full)]
        adapted = [name for name in matched if name in layers]
        if not adapted:
            rewritten[full] = style
            continue
        side = _split_side(style)
        for name in matched:
            if name not in layers:
                rewritten[name] = style
            elif side is None or not len(layers[name].lora_A):
                problems.append(f"tensor-parallel plan: {pattern!r}: {name!r} is a LoRA layer (peft) under style {style!r}; "
                                "torchrig splits LoRA layers only under column- or row-wise styles: leave this layer "
                                "out of LoraConfig.target_modules or give parallelism_config.tp_plan without it")
            else:
                rewritten[f"{name}.base_layer"] = style
                for adapter in (layers[name].lora_B if side == "output" else layers[name].lora_A):
                    rewritten[f"{name}.{'lora_B' if side == 'output' else 'lora_A'}.{adapter}"] = style
    if problems:
        raise ConfigError(problems)
    return rewritten


def apply_tensor_parallel(run: RunContext, model: torch.nn.Module, mesh: Any, parallelize_fn: Any,
                          require_match: bool = True) -> None:
    """:func:`torchrig_fsdp.mesh.apply_tensor_parallel`, with the plan made to follow LoRA adapters first
    (:func:`adapter_tp_plan`) when the model has some and no ``parallelize_fn`` is given: the head counts are
    checked on the adapted projections' names and tied parameters tied again, as for any plan."""
    config = mesh_module.parallelism(run)
    tp = mesh_module.tp_mesh(mesh)
    if parallelize_fn is not None or tp is None or not _lora_layers(model):
        mesh_module.apply_tensor_parallel(run, model, mesh, parallelize_fn, require_match)
        return
    where = f"{type(model).__name__}'s tensor-parallel plan, following its LoRA adapters"
    plan = adapter_tp_plan(model, config.tp_plan)
    if not plan:
        raise ConfigError([f"parallelism_config.tp_plan: tp_size is {tp.size()} but no plan says which modules to "
                           f"split and the model wrapped by {type(model).__name__} declares none; set tp_plan"])
    resolved = mesh_module.resolve_plan(model, plan, config.loss_parallel, where, require_match)
    layers = [name.removesuffix(".base_layer") for name in resolved]
    problems = hf_styles.check_heads_divide(model, layers, tp.size())
    if problems:
        raise ConfigError(problems)
    tied = mesh_module._tied_parameters(model)
    parallelize_module(model, tp, resolved)
    mesh_module._retie(model, tied, where)


__all__ = ["adapter_tp_plan", "apply_tensor_parallel", "as_modules", "wrap_blocks", "written_by_operator"]
