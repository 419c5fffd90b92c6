"""What happens to a model before the strategy wraps it: the check that nobody distributed it
already, and module conversion (``torchrig_convert_model``).

A conversion such as fp8 (``nn.Linear`` → ``Float8Linear``) may put new ``Parameter`` objects in
the module (torchao wraps weights for FSDP2's fp8 all-gather). Optimizers built before
``prepare`` hold the old ones and would then step tensors the model no longer uses, so every
replaced parameter is swapped in their param groups (and state) by its qualified name.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from torchrig.errors import ConfigError
from torchrig.host.plugin_host import PluginHost
from torchrig.host.run import RunContext


def refuse_distributed_model(model: Any) -> None:
    """Refuse a model whose parameters are already DTensors: distributed before ``prepare`` by
    transformers' ``from_pretrained(..., distributed_config=...)`` or by the user's own
    ``parallelize_module``/``fully_shard``. The strategy would wrap it a second time (DDP dies inside
    torch on a mixed DTensor/Tensor broadcast, FSDP2/TP re-shard what is sharded), and the run's
    checkpoints, clipping and loss reductions would not know that mesh. The message says what to do."""
    dtensor_module = sys.modules.get("torch.distributed.tensor")
    if dtensor_module is None:  # never imported, so no DTensor exists (importing it costs each rank ~0.6 s)
        return
    distributed = [(name, p) for name, p in model.named_parameters() if isinstance(p, dtensor_module.DTensor)]
    if not distributed:
        return
    total = sum(1 for _ in model.parameters())
    meshes = sorted({(tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.device_mesh.shape)) for _, p in distributed})
    described = "; ".join(f"mesh {tuple(names) or '(unnamed)'} of shape {shape}" for names, shape in meshes)
    raise ConfigError(
        f"prepare(): {type(model).__name__} is already distributed: {len(distributed)} of its {total} parameters "
        f"are DTensors ({described}; first: {distributed[0][0]!r}), laid out before prepare — by transformers' "
        "from_pretrained(..., distributed_config=DistributedConfig(...)) or your own parallelize_module/"
        "fully_shard. torchrig lays the model out itself, from the same plan: load it without distributed_config "
        "(or do not parallelize it) and set parallelism_config instead (e.g. ParallelismConfig(tp_size=2), "
        "--tp_size 2; the model's own tensor-parallel plan is used) with the fsdp strategy; see "
        "docs/huggingface.md")


def convert_model(host: PluginHost, run: RunContext, model: Any, optimizers: Sequence[Any]) -> int:
    """Ask the plugins to convert ``model`` in place; remap ``optimizers`` onto any parameter the
    conversion replaced. Returns how many parameters were replaced. A model distributed before
    ``prepare`` is refused first (:func:`refuse_distributed_model`)."""
    refuse_distributed_model(model)
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


__all__ = ["convert_model", "refuse_distributed_model", "remap_parameters"]
