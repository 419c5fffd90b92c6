"""Which submodules get their own ``fully_shard`` (``auto_wrap_policy``: Hugging Face's
``_no_split_modules``, named classes, torch's size-based rule, or an FSDP1-style callable), and
activation checkpointing of those blocks."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch
from torchrig.config.resolve import Layer
from torchrig.run import RunContext

from torchrig_fsdp.explain import FSDPConfigError, noted
from torchrig_fsdp.manifest import SECTION
from torchrig_fsdp.options import FullyShardedDataParallelPlugin


def written_by_operator(run: RunContext, key: str) -> str | None:
    """Where ``key`` was set when a machine default file, a config file, an environment variable
    or a flag set it (an explicit choice for this run); None for defaults and ``Accelerator(...)``
    arguments (an options object carries every field, chosen or not)."""
    where = run.option_source(key)
    return None if where is None or where.layer in (Layer.DEFAULT, Layer.ARGUMENT) else str(where)


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


def checkpoint_forward(block: torch.nn.Module) -> None:
    """Activation checkpointing of one block: its forward runs under ``torch.utils.checkpoint``
    (non-reentrant), inside FSDP2's hooks, so the recomputation in backward finds the block's
    parameters gathered. Parameter names are unchanged (unlike ``checkpoint_wrapper``)."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


__all__ = ["as_modules", "checkpoint_forward", "wrap_blocks", "written_by_operator"]
