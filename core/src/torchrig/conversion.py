"""Module conversion before the strategy wraps a model (``torchrig_convert_model``).

A conversion such as fp8 (``nn.Linear`` → ``Float8Linear``) may put new ``Parameter`` objects in
the module (torchao wraps weights for FSDP2's fp8 all-gather). Optimizers built before
``prepare`` hold the old ones and would then step tensors the model no longer uses, so every
replaced parameter is swapped in their param groups (and state) by its qualified name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torchrig.plugin_host import PluginHost
from torchrig.run import RunContext


def convert_model(host: PluginHost, run: RunContext, model: Any, optimizers: Sequence[Any]) -> int:
    """Ask the plugins to convert ``model`` in place; remap ``optimizers`` onto any parameter the
    conversion replaced. Returns how many parameters were replaced."""
    before = dict(model.named_parameters(remove_duplicate=False))
    host.hook.torchrig_convert_model(run=run, model=model)
    after = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(name for name in before if name not in after)
    if missing:
        raise RuntimeError(f"converting {type(model).__name__} removed parameters {missing[:5]}: a conversion "
                           "(torchrig_convert_model) must keep every parameter's qualified name")
    replaced = {id(old): after[name] for name, old in before.items() if after[name] is not old}
    for optimizer in optimizers:
        remap_parameters(optimizer, replaced)
    return len(replaced)


def remap_parameters(optimizer: Any, replaced: dict[int, Any]) -> None:
    """Point ``optimizer``'s param groups and state at the new parameters (``{id(old): new}``)."""
    if not replaced:
        return
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(p), p) for p in group["params"]]
    for old in [p for p in optimizer.state if id(p) in replaced]:
        optimizer.state[replaced[id(old)]] = optimizer.state.pop(old)


__all__ = ["convert_model", "remap_parameters"]
