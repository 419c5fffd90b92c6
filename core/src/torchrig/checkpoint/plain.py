"""Reading the core's plain checkpoint state (what single-process and DDP runs save), for strategies.

A sharding strategy resuming a checkpoint that a replicating strategy wrote (DDP -> FSDP2 x TP)
reads the full state here and distributes it itself: ``model.safetensors`` (or
``pytorch_model.bin``) and ``optimizer.safetensors`` — whose per-parameter state is keyed by the
parameter's position in the optimizer's param groups, as ``torch.optim.Optimizer.state_dict``
numbers them. :func:`optimizer_by_name` re-keys it by parameter name. Nothing is unpickled
beyond ``torch.load(weights_only=True)``. ``load_model_state`` is the core's module load (non-strict,
then every missing/unexpected key checked and named), for strategies whose engine loads a module
state dict itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torchrig.checkpoint.files import CheckpointError
from torchrig.checkpoint.layout import numbered
from torchrig.checkpoint.state_dicts import load_model_state, load_structured, model_files, read_model_file


def read_model_state(directory: str, index: int, location: Any = "cpu") -> dict[str, Any]:
    """The full state dict of model ``index`` (tied weights restored under every name)."""
    return read_model_file(directory, index, location)


def read_optimizer_state(directory: str, index: int, location: Any = "cpu") -> dict[str, Any]:
    """Optimizer ``index``'s ``state_dict()`` as saved (position-keyed)."""
    return load_structured(directory, numbered("optimizer", index, ""), location)


def optimizer_by_name(state: Mapping[str, Any], names: list[str], where: str) -> dict[str, Any]:
    """``state`` with parameter positions replaced by ``names`` (the optimizer's parameters, in
    param-group order, named as in the model): the layout-independent keys sharded loaders take."""
    groups = state.get("param_groups", [])
    count = sum(len(group.get("params", [])) for group in groups)
    if count != len(names):
        raise CheckpointError(f"{where}: the saved optimizer has {count} parameters in its groups, this one has "
                              f"{len(names)}; was it built over another model or other parameter groups?")
    renamed_groups = [{**group, "params": [names[int(position)] for position in group.get("params", [])]}
                      for group in groups]
    return {"state": {names[int(position)]: value for position, value in state.get("state", {}).items()},
            "param_groups": renamed_groups}


__all__ = ["load_model_state", "model_files", "optimizer_by_name", "read_model_state", "read_optimizer_state"]
