"""Weights for other tools: ``save_model`` (sharded safetensors with an index) and ``save``.

``save_model`` writes Hugging Face's layout — ``model.safetensors``, or
``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json`` (``metadata``
and ``weight_map``); ``pytorch_model*.bin`` without safe serialization — so ``transformers`` and
``safetensors`` read it. Every file is written under a temporary name, fsynced and renamed; the
index is written last, and shards of an earlier save that the new index no longer names are
removed, so a reader never sees a mixture.

``save_pretrained_files`` is what ``Accelerator.save_model`` writes: the weights under the names
``transformers`` uses (:mod:`torchrig.checkpoint.hf_names`: wrapper segments removed, tied weights
once), ``config.json``/``generation_config.json`` when the model has a config, and for a peft
model its adapters alone, written by peft's own ``save_pretrained`` (``adapter_model.safetensors``
+ ``adapter_config.json``, the layout ``PeftModel.from_pretrained`` loads).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Mapping
from typing import Any

from torchrig.checkpoint.files import SAFETENSORS_METADATA_KEY, CheckpointError, describe_os_error, fsync_path
from torchrig.checkpoint.hf_names import clean_name, is_peft_model, transformers_state, write_config_files
from torchrig.checkpoint.state_dicts import ALIASES_KEY, split_aliases

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30,
          "TIB": 2**40}
SAFE_WEIGHTS, SAFE_INDEX = "model.safetensors", "model.safetensors.index.json"
PT_WEIGHTS, PT_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


def parse_size(size: int | str) -> int:
    """``"10GB"``, ``"500MiB"``, ``1000`` → bytes."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"max_shard_size must be positive, not {size}")
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", str(size).upper())
    if not match:
        raise ValueError(f"max_shard_size={size!r}: expected bytes or a size like '10GB' or '500MiB'")
    return int(float(match[1]) * _UNITS[match[2]])


def shard(state: Mapping[str, Any], max_bytes: int) -> list[dict[str, Any]]:
    """Split a state dict into consecutive shards of at most ``max_bytes`` (a bigger tensor gets
    a shard of its own)."""
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_atomic(path: str, write: Any) -> None:
    """``write(tmp)`` a temporary name beside ``path``, fsync it, rename it into place."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise CheckpointError(describe_os_error(exc, path)) from exc
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_weights(state: Mapping[str, Any], directory: str, max_shard_size: int | str = "10GB",
                 safe_serialization: bool = True) -> list[str]:
    """Write a full state dict as (sharded) weights files; returns the file names written."""
    import torch

    limit = parse_size(max_shard_size)
    if safe_serialization and SAFETENSORS_METADATA_KEY in state:
        raise CheckpointError(f"cannot save the weights into {directory}: the state has a tensor named "
                              f"{SAFETENSORS_METADATA_KEY!r}, the key the safetensors format reserves for a file's "
                              "metadata (such a file cannot be loaded back); rename that parameter or buffer, or pass "
                              "safe_serialization=False")
    os.makedirs(directory, exist_ok=True)
    tensors = {name: value.detach().to("cpu").contiguous() for name, value in state.items()}
    aliases: dict[str, str] = {}
    if safe_serialization:
        tensors, aliases = split_aliases(tensors)
    shards = shard(tensors, limit)
    weights, index_name = (SAFE_WEIGHTS, SAFE_INDEX) if safe_serialization else (PT_WEIGHTS, PT_INDEX)
    names = shard_names(weights, len(shards))
    metadata = {"format": "pt"}
    if aliases:
        metadata[ALIASES_KEY] = json.dumps(aliases)
    for name, part in zip(names, shards):
        path = os.path.join(directory, name)
        if safe_serialization:
            from safetensors.torch import save_file

            write_atomic(path, lambda tmp, part=part: save_file(part, tmp, metadata=metadata))
        else:
            write_atomic(path, lambda tmp, part=part: torch.save(part, tmp))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    written = [*names, *write_index_and_prune(directory, weights, index_name, names, shards, total, aliases)]
    fsync_path(directory)
    return written


def shard_names(weights: str, count: int) -> list[str]:
    """transformers' file names: ``weights`` alone, or ``<stem>-00001-of-0000N.<suffix>`` for ``count`` shards."""
    stem, suffix = weights.rsplit(".", 1)
    return [weights] if count == 1 else [f"{stem}-{i + 1:05d}-of-{count:05d}.{suffix}" for i in range(count)]


def write_index_and_prune(directory: str, weights: str, index_name: str, names: list[str],
                          shards: list[Mapping[str, Any]], total_size: int,
                          aliases: Mapping[str, str] | None = None) -> list[str]:
    """After the weights files ``names`` (``weights``, or its numbered shards) are written: the index (``weight_map``, aliases
    pointing at their source's file) when there are several, else no stale index of an earlier sharded
    save; and no weights file of an earlier save that this one did not write. Returns ``[index_name]``
    when an index was written."""
    stem, suffix = weights.rsplit(".", 1)
    index_path = os.path.join(directory, index_name)
    written = []
    if len(shards) > 1:
        weight_map = {name: file for file, part in zip(names, shards) for name in part}
        for alias, name in (aliases or {}).items():
            weight_map[alias] = weight_map[name]
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}

        def write_index(tmp: str) -> None:
            with open(tmp, "w") as handle:
                json.dump(index, handle, indent=2)
                handle.write("\n")

        write_atomic(index_path, write_index)
        written.append(index_name)
    elif os.path.exists(index_path):
        os.unlink(index_path)  # an earlier sharded save's index would point at stale shards
    pattern = re.compile(rf"^{re.escape(stem)}(-\d{{5}}-of-\d{{5}})?\.{re.escape(suffix)}$")
    for name in os.listdir(directory):
        if pattern.match(name) and name not in names:
            os.unlink(os.path.join(directory, name))
    return written


def save_pretrained_files(model: Any, state: Mapping[str, Any], directory: str, max_shard_size: int | str = "10GB",
                          safe_serialization: bool = True) -> list[str]:
    """Write the gathered full ``state`` of ``model`` (its unwrapped module) as ``from_pretrained``
    reads it: a peft model's adapters alone, any other model's weights under transformers' names
    plus its config files. Returns the file names written."""
    if is_peft_model(model):
        os.makedirs(directory, exist_ok=True)
        before = set(os.listdir(directory))
        adapter_state = {clean_name(name): value for name, value in state.items()}
        model.save_pretrained(directory, state_dict=adapter_state, safe_serialization=safe_serialization)
        fsync_path(directory)
        return sorted(set(os.listdir(directory)) - before) or sorted(
            name for name in os.listdir(directory) if name.startswith(("adapter_model", "adapter_config")))
    written = save_weights(transformers_state(state, model), directory, max_shard_size, safe_serialization)
    written += write_config_files(model, directory)
    fsync_path(directory)
    return written


def save_object(obj: Any, path: str, safe_serialization: bool = False) -> None:
    """``Accelerator.save``: one object, written atomically (``torch.save`` or safetensors)."""
    import torch

    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    if safe_serialization:
        from safetensors.torch import save_file

        if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise TypeError("save(..., safe_serialization=True) needs a mapping of names to tensors")
        tensors, aliases = split_aliases({k: v.detach().to("cpu").contiguous() for k, v in obj.items()})
        metadata = {"format": "pt", **({ALIASES_KEY: json.dumps(aliases)} if aliases else {})}
        write_atomic(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))
    else:
        write_atomic(path, lambda tmp: torch.save(obj, tmp))
    fsync_path(directory)


__all__ = ["parse_size", "save_object", "save_pretrained_files", "save_weights", "shard", "shard_names", "write_atomic", "write_index_and_prune"]
