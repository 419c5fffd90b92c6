"""Hugging Face safetensors weights into a model already prepared in any layout (FSDP2, TP,
FSDP2×TP, a pipeline stage, DDP, one process): ``Accelerator.load_pretrained_weights``.

Built on torch's DCP ``HuggingFaceStorageReader``: DCP's planner asks each rank for exactly the
chunks its own tensors hold (a DTensor's local shard, a plain tensor whole), and the reader takes
them from the files with safetensors' ``get_slice`` — a rank reads the bytes of its own shards and
nothing else, no rank ever holds a full copy of a sharded tensor, the model is never assembled in
CPU memory. Each slice is copied into the parameter in place (``copy_``, which converts the file's
dtype to the parameter's) and dropped, so besides its shards a rank holds at most one slice.
A strided shard (a fused gate/up projection split part by part, e.g. MoE experts under TP) is
several slices of the full tensor, which DCP's planner would read as one contiguous chunk — the
wrong values, silently: those are read here run by run with the same ``get_slice``.

Names are transformers' (:mod:`torchrig.checkpoint.hf_names`): wrapper segments removed, a tied
weight once under its source name. Keys are compared over the union of every rank's keys (a
pipeline stage holds only its own layers), so a missing or unexpected key is one the whole model
lacks or the files lack, named with both lists before any byte is read; so is a shape mismatch.

How much was read is counted where it is read (the bytes of every slice taken from the files, and
the largest one): on CPU that is the honest measure of what loading costs a rank — ``tracemalloc``
does not see torch's allocations, and the resident size counts the page cache of mmapped files.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from torchrig.checkpoint.export import SAFE_INDEX, SAFE_WEIGHTS
from torchrig.checkpoint.files import CheckpointError
from torchrig.checkpoint.hf_names import tied_targets, transformers_state

_SHOWN = 12


@attrs.frozen
class PretrainedLoad:
    """What :func:`load_pretrained_weights` did on this rank."""

    #: The weights files read (absolute paths).
    files: tuple[str, ...]
    #: Keys the model has and the files lack (``strict=False`` only; else an error).
    missing: tuple[str, ...]
    #: Keys the files have and the model lacks (``strict=False`` only; else an error).
    unexpected: tuple[str, ...]
    #: Bytes this rank read from the files (its own shards, in the files' dtype).
    bytes_read: int
    #: The largest single slice this rank read.
    largest_read: int


def weights_files(path: str) -> list[str]:
    """The safetensors files of ``path``: a ``.safetensors`` file, or a directory with
    ``model.safetensors.index.json`` (the files its ``weight_map`` names) or ``model.safetensors``."""
    if os.path.isfile(path):
        if not path.endswith(".safetensors"):
            raise CheckpointError(f"load_pretrained_weights: {path} is not a .safetensors file; give a "
                                  f"'.safetensors' file or a directory holding {SAFE_WEIGHTS} or {SAFE_INDEX}")
        return [os.path.abspath(path)]
    if not os.path.isdir(path):
        raise CheckpointError(f"load_pretrained_weights: {path} does not exist; give a directory written by "
                              "save_pretrained/save_model or a '.safetensors' file")
    index = os.path.join(path, SAFE_INDEX)
    if os.path.exists(index):
        try:
            with open(index) as handle:
                weight_map = json.load(handle)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"load_pretrained_weights: {index} is not a safetensors index (a JSON object with "
                                  f"a 'weight_map'): {exc}") from exc
        files = [os.path.abspath(os.path.join(path, name)) for name in sorted(set(weight_map.values()))]
        absent = [name for name in files if not os.path.exists(name)]
        if absent:
            raise CheckpointError(f"load_pretrained_weights: {index} names files that are not there: "
                                  f"{', '.join(os.path.basename(name) for name in absent)}")
        return files
    single = os.path.join(path, SAFE_WEIGHTS)
    if os.path.exists(single):
        return [os.path.abspath(single)]
    raise CheckpointError(f"load_pretrained_weights: {path} holds neither {SAFE_INDEX} nor {SAFE_WEIGHTS} "
                          "(pytorch_model.bin is not read: it is a pickle and cannot be read in slices); save the "
                          "weights with safe_serialization=True")


def _file_shapes(files: list[str]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Each key's shape and file, from the files' headers alone."""
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, str] = {}
    for name in files:
        with safe_open(name, framework="pt") as handle:  # reads the header only
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
                where[key] = name
    return shapes, where


def _strided(value: Any) -> bool:
    """A DTensor with a strided shard (a packed/fused projection split part by part): its local
    chunk is several slices of the full tensor, which DCP's planner reads as one (wrongly)."""
    return any(isinstance(p, _StridedShard) for p in getattr(value, "placements", ()))


def _local_indices(value: Any) -> list[torch.Tensor]:
    """Per dimension, the global indices this rank's chunk of the DTensor ``value`` holds: a 1-D
    index split the way ``value``'s placements split that dimension (no communication)."""
    indices = []
    for dim, size in enumerate(value.shape):
        placements: list[Any] = []
        for placement in value.placements:
            if isinstance(placement, _StridedShard) and placement.dim == dim:
                placements.append(_StridedShard(0, split_factor=placement.split_factor))
            elif isinstance(placement, Shard) and placement.dim == dim:
                placements.append(Shard(0))
            else:
                placements.append(Replicate())
        index = torch.arange(size)
        if any(not isinstance(p, Replicate) for p in placements):
            index = distribute_tensor(index, value.device_mesh, placements, src_data_rank=None).to_local()
        indices.append(index)
    return indices


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(local start, global start, length)`` of each run of consecutive global indices."""
    runs: list[tuple[int, int, int]] = []
    for local, global_index in enumerate(index.tolist()):
        if runs and runs[-1][1] + runs[-1][2] == global_index:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((local, global_index, 1))
    return runs


def _read_strided(values: Mapping[str, Any], where: Mapping[str, str], reader: _CountingReader) -> None:
    """Read each strided DTensor's local chunk slice by slice (every run of consecutive indices
    of every dimension), counted like DCP's reads."""
    for key, value in values.items():
        local = value.to_local()
        runs = [_runs(index) for index in _local_indices(value)]
        with safe_open(where[key], framework="pt") as handle:
            source = handle.get_slice(key)
            for combination in itertools.product(*runs):
                piece = source[tuple(slice(g, g + n) for _, g, n in combination)]
                reader.count(piece)
                local[tuple(slice(start, start + n) for start, _, n in combination)].copy_(piece)


def _global_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    return tuple(tensor.shape)  # a DTensor's shape is its global shape


def _union(keys: set[str]) -> set[str]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return keys
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(keys))
    return set().union(*(set(part) for part in gathered))


def _listed(keys: set[str]) -> str:
    shown = sorted(keys)[:_SHOWN]
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return ", ".join(repr(key) for key in shown) + more


class _FilesOnly:
    """The reader's file system, listing only the weights files (a directory may hold others,
    e.g. an adapter, whose keys must not mix in)."""

    def __init__(self, inner: Any, files: list[str]) -> None:
        self._inner, self._files = inner, files

    def ls(self, path: Any) -> list[str]:
        return list(self._files)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _CountingReader(HuggingFaceStorageReader):
    """DCP's Hugging Face reader over the listed files, counting the bytes of every slice read."""

    def __init__(self, directory: str, files: list[str]) -> None:
        super().__init__(directory)
        self.fs = _FilesOnly(self.fs, files)
        self.bytes_read = 0
        self.largest_read = 0

    def count(self, piece: torch.Tensor) -> None:
        nbytes = piece.numel() * piece.element_size()
        self.bytes_read += nbytes
        self.largest_read = max(self.largest_read, nbytes)

    def _process_read_request(self, f: Any, req: Any, planner: Any) -> None:
        slices = tuple(slice(offset, offset + length) for offset, length in zip(req.storage_offsets, req.lengths))
        piece = f.get_slice(req.storage_index.fqn)[slices]
        self.count(piece)
        target = planner.resolve_tensor(req).detach()
        if target.size() != piece.size():
            raise CheckpointError(f"load_pretrained_weights: {req.storage_index.fqn!r}: a slice of "
                                  f"{tuple(piece.size())} for a local shard of {tuple(target.size())}")
        target.copy_(piece)
        planner.commit_tensor(req, target)


def load_pretrained_weights(model: torch.nn.Module, path: str | os.PathLike, strict: bool = True) -> PretrainedLoad:
    """Load the safetensors weights at ``path`` into ``model`` (the unwrapped module of a prepared
    model, in whatever layout) in place; collective when a process group exists. ``strict``: a
    key the model has and the files lack, or the reverse, is an error naming them (otherwise they
    are returned). A shape mismatch is always an error."""
    path = os.fspath(path)
    files = weights_files(path)
    file_shapes, where = _file_shapes(files)
    state = transformers_state(model.state_dict(), model)
    tied = set(tied_targets(model))
    mine = set(state)
    everyone = _union(mine)
    missing = everyone - set(file_shapes)
    unexpected = set(file_shapes) - everyone - tied
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the files (the model has them): {_listed(missing)}")
        if unexpected:
            parts.append(f"unexpected (in the files, not in the model): {_listed(unexpected)}")
        converted = (" Both lists: the files may store the weights in another layout that transformers converts on "
                     "load (e.g. MoE experts stored one by one, fused in the model), which is not applied here — "
                     "load such files with from_pretrained before prepare." if missing and unexpected else "")
        raise CheckpointError(f"load_pretrained_weights({path}): {'; '.join(parts)}. The names are transformers' "
                              f"(wrapper segments removed, tied weights once); pass strict=False to load the keys "
                              f"both have.{converted}")
    wrong = {key: (file_shapes[key], _global_shape(state[key])) for key in mine & set(file_shapes)
             if isinstance(state[key], torch.Tensor) and file_shapes[key] != _global_shape(state[key])}
    if wrong:
        listed = "; ".join(f"{key!r}: files {a}, model {b}" for key, (a, b) in sorted(wrong.items())[:_SHOWN])
        raise CheckpointError(f"load_pretrained_weights({path}): shapes differ — {listed}. Load into a model built "
                              "from the same config (a model whose parameters a strategy partitioned away from "
                              "their shapes, such as DeepSpeed ZeRO-3, loads its weights before prepare)")
    to_load = {key: value for key, value in state.items() if key in file_shapes and not _strided(value)}
    strided = {key: value for key, value in state.items() if key in file_shapes and _strided(value)}
    reader = _CountingReader(os.path.dirname(files[0]), files)
    distributed = dist.is_available() and dist.is_initialized()
    try:
        with torch.no_grad():
            dcp_load(to_load, storage_reader=reader, no_dist=not distributed)
            _read_strided(strided, where, reader)
    except BaseException as exc:  # DCP's CheckpointException is not an Exception
        if isinstance(exc, (KeyboardInterrupt, SystemExit, CheckpointError)):
            raise
        raise CheckpointError(f"load_pretrained_weights({path}): reading the weights failed: {exc}") from exc
    return PretrainedLoad(files=tuple(files), missing=tuple(sorted(missing)), unexpected=tuple(sorted(unexpected)),
                          bytes_read=reader.bytes_read, largest_read=reader.largest_read)


def local_bytes(model: torch.nn.Module, dtype_of: Mapping[str, torch.dtype] | None = None) -> int:
    """Bytes of this rank's own shards of ``model``'s state (tied weights once), in ``dtype_of``'s
    dtype per key when given — what :func:`load_pretrained_weights` should read on this rank."""
    total = 0
    for key, value in transformers_state(model.state_dict(), model).items():
        local = value.to_local() if hasattr(value, "to_local") else value
        size = (dtype_of[key].itemsize if dtype_of and key in dtype_of else local.element_size())
        total += local.numel() * size
    return total


__all__ = ["PretrainedLoad", "load_pretrained_weights", "local_bytes", "weights_files"]
