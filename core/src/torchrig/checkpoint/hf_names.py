"""Tensor names as ``transformers`` writes and reads them, shared by ``save_model`` and
``load_pretrained_weights``.

A prepared model's state dict can carry names that wrappers added (``_orig_mod.`` from
``torch.compile``, ``_checkpoint_wrapped_module.`` from activation checkpointing,
``_fsdp_wrapped_module.`` from FSDP1) and holds a tied weight under both of its names
(``lm_head.weight`` and ``model.embed_tokens.weight``). ``save_pretrained`` writes neither: the
wrappers' segments are gone and a tied weight appears once, under its source name. These
functions make a state dict look that way, so the files load with ``from_pretrained`` and files
written by ``save_pretrained`` load into a prepared model.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from typing import Any

#: Name segments that wrappers insert between a module and its children.
WRAPPER_SEGMENTS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def clean_name(name: str) -> str:
    """``name`` without the segments wrappers insert (``layers.0._orig_mod.mlp`` → ``layers.0.mlp``)."""
    for segment in WRAPPER_SEGMENTS:
        name = name.replace(segment, "")
    return name


def tied_targets(model: Any) -> dict[str, str]:
    """``{tied name: source name}`` of the weights ``model`` ties, as transformers declares them:
    ``all_tied_weights_keys`` (transformers 5, only the ties the config turns on). Empty for a
    model that declares none (ties by identity are then found by :func:`split_tied`)."""
    declared = getattr(model, "all_tied_weights_keys", None)
    if isinstance(declared, Mapping):
        return {str(target): str(source) for target, source in declared.items()}
    return {}


def transformers_state(state: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """``state`` under the names ``save_pretrained`` writes: wrapper segments removed, each tied
    weight once under its source name. Two names that clean to the same name are an error naming
    both (the files would hold one of them silently)."""
    cleaned: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for name, value in state.items():
        clean = clean_name(name)
        if clean in cleaned:
            raise ValueError(f"save_model: the model's state names {origin[clean]!r} and {name!r} both become "
                             f"{clean!r} once wrapper segments {WRAPPER_SEGMENTS} are removed; rename one of them")
        cleaned[clean], origin[clean] = value, name
    for target, source in tied_targets(model).items():
        if target in cleaned and source in cleaned:
            del cleaned[target]
    return cleaned


def model_config(model: Any) -> Any | None:
    """A transformers-style config of ``model`` (has ``save_pretrained``), or None."""
    config = getattr(model, "config", None)
    return config if callable(getattr(config, "save_pretrained", None)) else None


def write_config_files(model: Any, directory: str) -> list[str]:
    """``config.json`` (with ``architectures`` as ``save_pretrained`` records it) and
    ``generation_config.json`` when the model has them; returns the names written."""
    config = model_config(model)
    if config is None:
        return []
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    written = ["config.json"]
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if generation is not None and callable(getattr(generation, "save_pretrained", None)) \
            and (not callable(can_generate) or can_generate()):
        generation.save_pretrained(directory)
        written.append("generation_config.json")
    return [name for name in written if os.path.exists(os.path.join(directory, name))]


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a peft model (its adapters are what ``save_pretrained`` writes)."""
    return isinstance(getattr(model, "peft_config", None), Mapping) and hasattr(model, "active_adapter") \
        and callable(getattr(model, "save_pretrained", None))


__all__ = ["WRAPPER_SEGMENTS", "clean_name", "is_peft_model", "model_config", "tied_targets", "transformers_state",
           "write_config_files"]
