"""``torch.compile`` as torchrig applies it (``TorchDynamoPlugin``, after the strategy wrapped the
model) and Accelerate's compile helpers (``compile_regions``, ``is_compiled_module``...)."""

from __future__ import annotations

from typing import Any

import torch


def compile_model(model: torch.nn.Module, dynamo: Any) -> torch.nn.Module:
    """Compile ``model`` with the ``TorchDynamoPlugin`` options ``dynamo``: the whole model, or
    with ``use_regional_compilation`` each block of its ``ModuleList``\\ s in place."""
    kwargs: dict[str, Any] = {"backend": dynamo.backend, "fullgraph": dynamo.fullgraph, "dynamic": dynamo.dynamic}
    if dynamo.mode:
        kwargs["mode"] = dynamo.mode
    if dynamo.options:
        kwargs["options"] = dynamo.options
    if not dynamo.use_regional_compilation:
        return torch.compile(model, **kwargs)
    for module in model.modules():
        for _, child in list(module.named_children()):
            if isinstance(child, torch.nn.ModuleList):
                for index, block in enumerate(child):
                    child[index] = torch.compile(block, **kwargs)
    return model


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` is the result of ``torch.compile``."""
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule)


def has_compiled_regions(module: torch.nn.Module) -> bool:
    """Whether some submodule of ``module`` (or itself) was compiled."""
    return bool(module._modules) and any(is_compiled_module(sub) for sub in module.modules())


def _is_repeated_blocks(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.ModuleList) and len(module) > 0 and all(
        isinstance(block, type(module[0])) for block in module)


def _has_repeated_blocks(module: torch.nn.Module) -> bool:
    return bool(module._modules) and any(_is_repeated_blocks(sub) for sub in module.modules())


def compile_regions(module: torch.nn.Module, **compile_kwargs: Any) -> torch.nn.Module:
    """Accelerate's regional compilation: a copy of ``module`` in which every block of a
    ``ModuleList`` of same-class blocks is compiled separately (so they share the compiler's cache)
    and every other leaf subtree is compiled whole. The original stays reachable as ``_orig_mod``."""

    def regions(current: torch.nn.Module) -> torch.nn.Module:
        if _is_repeated_blocks(current):
            return torch.nn.ModuleList(torch.compile(block, **compile_kwargs) for block in current)
        if _has_repeated_blocks(current):
            copy = current.__class__.__new__(current.__class__)
            copy.__dict__.update(current.__dict__)
            copy._modules = {}
            for name, child in current.named_children():
                copy.add_module(name, regions(child))
            return copy
        return torch.compile(current, **compile_kwargs)

    compiled = regions(module)
    if "_orig_mod" not in compiled.__dict__:
        compiled.__dict__["_orig_mod"] = module
    return compiled


__all__ = ["compile_model", "compile_regions", "has_compiled_regions", "is_compiled_module"]
