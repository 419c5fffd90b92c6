"""Meta-device models get their weights after sharding, without any rank holding the whole model.

``with init_empty_weights(): model = build()`` makes parameters on the ``meta`` device (shapes
only). ``prepare`` applies tensor parallelism and ``fully_shard`` to that meta model, so every
rank's shards are laid out before any memory exists; then each rank allocates only its shards
(``to_empty``) and they are filled, module by module:

* on rank 0 the module's direct parameters and buffers are swapped for full-size plain tensors
  and initialised — ``fsdp_config.param_init_fn(module)`` when given, else the module's own
  ``reset_parameters()`` — then swapped back;
* those full tensors are sharded into every rank's DTensors
  (``set_model_state_dict(..., broadcast_from_rank0=True)``), a batch of modules at a time (at
  most :data:`BATCH_BYTES` of full tensors at once, one tensor at a time on the other ranks).

Why rank 0 and module order: the weights are then exactly those of ``torch.manual_seed(s);
build()`` on one process (the constructors draw from the same generator in the same order),
whatever the mesh — sharded DTensors initialised on each rank would draw from each rank's own
generator, so the model would depend on the layout. ``cpu_ram_efficient_loading`` (rank 0 holds
real weights) and ``load_state`` from a checkpoint (each rank reads its shards) are the other
ways in; docs/parallelism.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

#: Full tensors rank 0 builds before they are sharded out (one module is never split).
BATCH_BYTES = 256 * 1024 * 1024


class MaterializeError(ValueError):
    """Meta tensors nothing can initialise; the message names the key and the modules."""


def meta_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules (name, module), in ``named_modules`` order, with a direct meta parameter or buffer."""
    return [(name, module) for name, module in model.named_modules()
            if any(t is not None and t.is_meta for t in [*module._parameters.values(), *module._buffers.values()])]


def _initialiser(modules: list[tuple[str, torch.nn.Module]], param_init_fn: Any, key: str
                 ) -> Callable[[torch.nn.Module], Any]:
    if param_init_fn is not None:
        return param_init_fn
    missing = [name or "(root)" for name, module in modules if not callable(getattr(module, "reset_parameters", None))]
    if missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise MaterializeError(
            f"{key}: the model has tensors on the meta device in modules without reset_parameters() ({shown}) and "
            "nothing else initialises them; pass FullyShardedDataParallelPlugin(param_init_fn=fn) (fn(module) "
            "initialises one module's own parameters), set cpu_ram_efficient_loading: true with real weights on "
            "rank 0, or build the model with real weights")
    return lambda module: module.reset_parameters()


def _full_bytes(module: torch.nn.Module) -> int:
    """Bytes of the module's direct tensors at full size (a DTensor's shape is its global shape)."""
    return sum(t.numel() * t.element_size() for t in [*module._parameters.values(), *module._buffers.values()]
               if t is not None)


def _initialise_full(module: torch.nn.Module, init: Callable[[torch.nn.Module], Any], device: torch.device
                     ) -> dict[str, torch.Tensor]:
    """Rank 0: the module's direct tensors, at full size, as ``init`` leaves them."""
    originals = {"p": dict(module._parameters), "b": dict(module._buffers)}
    try:
        for name, param in originals["p"].items():
            if param is not None:
                module._parameters[name] = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device),
                                                              requires_grad=param.requires_grad)
        for name, buffer in originals["b"].items():
            if buffer is not None:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)
        with torch.no_grad():
            init(module)
        full = {name: t.detach() for name, t in module._parameters.items() if t is not None}
        full.update({name: t for name, t in module._buffers.items() if t is not None})
        return full
    finally:
        module._parameters.update(originals["p"])
        module._buffers.update(originals["b"])


def materialize(model: torch.nn.Module, modules: list[tuple[str, torch.nn.Module]], param_init_fn: Any,
                device: torch.device, is_main_process: bool, key: str) -> None:
    """Initialise ``modules`` (found by :func:`meta_modules` before ``to_empty``) on rank 0 and shard
    them into every rank's (already allocated) tensors. Collective."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    init = _initialiser(modules, param_init_fn, key)
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        with torch.no_grad():  # one process: nothing is sharded, the module is initialised in place
            for _, module in modules:
                init(module)
        return
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    batch: dict[str, torch.Tensor] = {}
    size = 0
    for index, (name, module) in enumerate(modules):
        if is_main_process:
            prefix = f"{name}." if name else ""
            batch.update({prefix + local: tensor for local, tensor in _initialise_full(module, init, device).items()})
        size += _full_bytes(module)  # the same on every rank: all ranks flush together
        if size >= BATCH_BYTES or index == len(modules) - 1:
            set_model_state_dict(model, batch, options=options)
            batch, size = {}, 0


__all__ = ["BATCH_BYTES", "MaterializeError", "materialize", "meta_modules"]
