"""Read a safetensors file straight into the live tensors it restores.

``load_state`` restores into a model and optimizer that already hold tensors of the right shape.
Reading through ``safe_open`` maps the file, copies every tensor out of the mapping into the live
one, then unmaps it: a page fault per page, a second pass over the bytes, and an ``munmap`` of
hundreds of MB at the end (a fifth of a load on a 539 MB checkpoint here). Reading each tensor's
bytes with ``preadv`` into the live tensor's own memory is one copy from the page cache and
nothing to free. Only tensors that match exactly (CPU, contiguous, same dtype and shape) are read
this way; every other entry is read by the library as before, and the caller's
``load_state_dict`` then finds the live tensor already holding the value (``copy_`` of a tensor
onto its own memory returns at once).

The whole header is checked (dtypes, shapes, offsets inside the file, sizes that agree) before a
single byte lands in a live tensor, so a damaged file is refused with the live state untouched.
Format: https://github.com/huggingface/safetensors#format.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any

import torch
from safetensors import safe_open

from torchrig.checkpoint.files import CheckpointError
from torchrig.checkpoint.hashed_safetensors import DTYPE_CODES

#: a header larger than this is not one torchrig (or the library, whose limit is the same) wrote.
_MAX_HEADER = 100_000_000
#: Linux transfers at most this many bytes per read call.
_MAX_READ = 0x7FFFF000
_ITEMSIZES = {code: dtype.itemsize for dtype, code in DTYPE_CODES.items()}


def _header(fd: int, path: str, size: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """The file's tensor entries, its ``__metadata__`` and where its data starts, checked."""
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, shorter than its header length")
    (length,) = struct.unpack("<Q", raw)
    if length > min(_MAX_HEADER, size - 8):
        raise CheckpointError(f"{path} is damaged: its header claims {length} bytes, the file has {size}")
    try:
        header = json.loads(os.pread(fd, length, 8))
    except ValueError as exc:
        raise CheckpointError(f"{path} is damaged: its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is damaged: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + length
    for name, entry in header.items():
        try:
            first, end = entry["data_offsets"]
            shape = [int(n) for n in entry["shape"]]
            dtype = entry["dtype"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path} is damaged: the entry of {name!r} is malformed ({exc!r})") from exc
        itemsize = _ITEMSIZES.get(dtype)
        if not (isinstance(first, int) and isinstance(end, int) and 0 <= first <= end <= size - start
                and all(n >= 0 for n in shape)
                and (itemsize is None or end - first == math.prod(shape) * itemsize)):
            raise CheckpointError(f"{path} is damaged: tensor {name!r} ({dtype}, shape {shape}) has offsets "
                                  f"{entry['data_offsets']} that do not fit its size or the file ({size} bytes)")
    return header, metadata, start


def _fits(target: Any, entry: Mapping[str, Any]) -> bool:
    return (isinstance(target, torch.Tensor) and target.device.type == "cpu" and target.layout == torch.strided
            and DTYPE_CODES.get(target.dtype) == entry["dtype"] and list(target.shape) == entry["shape"]
            and target.is_contiguous() and not target.is_conj() and not target.is_neg())


def _read_exactly(fd: int, target: torch.Tensor, offset: int, path: str, name: str) -> None:
    view = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < view.nbytes:
        count = os.preadv(fd, [view[done:done + _MAX_READ]], offset + done)
        if count == 0:
            raise CheckpointError(f"{path} ended while reading tensor {name!r} ({done} of {view.nbytes} bytes)")
        done += count


def read_into(path: str, targets: Mapping[str, Any],
              location: Any = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the safetensors file ``path`` by name, and the file's metadata: for a name in
    ``targets`` whose tensor matches the entry exactly, that tensor itself, its bytes now read
    from the file; every other entry read by the library onto ``location``."""
    with open(path, "rb", buffering=0) as handle:
        fd = handle.fileno()
        header, metadata, start = _header(fd, path, os.fstat(fd).st_size)
        direct = {} if str(location) != "cpu" else {
            name: targets[name] for name, entry in header.items() if _fits(targets.get(name), entry)}
        for name, target in direct.items():
            if target.numel():
                _read_exactly(fd, target, start + header[name]["data_offsets"][0], path, name)
    state = dict(direct)
    rest = [name for name in header if name not in direct]
    if rest:
        with safe_open(path, framework="pt", device=str(location)) as library:
            state.update((name, library.get_tensor(name)) for name in rest)
    return state, metadata


__all__ = ["read_into"]
