"""Read a safetensors file straight into the live tensors it restores.

``load_state`` restores into a model and optimizer that already hold tensors of the right shape.
Reading through ``safe_open`` maps the file, copies every tensor out of the mapping into the live
one, then unmaps it: a page fault per page, a second pass over the bytes, and an ``munmap`` of
hundreds of MB at the end (a fifth of a load on a 539 MB checkpoint here). Reading each tensor's
bytes with ``preadv`` into the live tensor's own memory is one copy from the page cache and
nothing to free; large files are read by a few threads at once (each copy runs on its own core). Only tensors that match exactly (CPU, contiguous, same dtype and shape) are read
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
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from safetensors import safe_open

from torchrig.checkpoint.files import CheckpointError
from torchrig.checkpoint.hashed_safetensors import DTYPE_CODES

#: a header larger than this is not one torchrig (or the library, whose limit is the same) wrote.
_MAX_HEADER = 100_000_000
#: Direct reads are cut into pieces of this size (Linux transfers at most 0x7FFFF000 bytes per
#: call) and spread over up to :data:`_THREADS` threads: a page-cache copy runs at the speed of one
#: core, and loading is the only work while it runs.
_PIECE = 32 << 20
_THREADS = min(4, os.cpu_count() or 1)
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


def _pieces(direct: Mapping[str, torch.Tensor], header: Mapping[str, Any],
            start: int) -> list[tuple[memoryview, int, str]]:
    """(destination bytes, file offset, tensor name) for every direct read, in pieces of at most
    :data:`_PIECE` bytes so that threads share the work evenly."""
    pieces = []
    for name, target in direct.items():
        if not target.numel():
            continue
        view = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())
        base = start + header[name]["data_offsets"][0]
        pieces.extend((view[at:at + _PIECE], base + at, name) for at in range(0, view.nbytes, _PIECE))
    return pieces


def _read_piece(fd: int, view: memoryview, offset: int, name: str, path: str) -> None:
    done = 0
    while done < view.nbytes:
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise CheckpointError(f"{path} ended while reading tensor {name!r} (at byte {offset + done})")
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
        pieces = _pieces(direct, header, start)
        if len(pieces) > 1 and _THREADS > 1:  # the kernel copies release the GIL: one per core
            with ThreadPoolExecutor(_THREADS, thread_name_prefix="torchrig-load") as pool:
                list(pool.map(lambda piece: _read_piece(fd, *piece, path), pieces))
        else:
            for piece in pieces:
                _read_piece(fd, *piece, path)
    state = dict(direct)
    rest = [name for name in header if name not in direct]
    if rest:
        with safe_open(path, framework="pt", device=str(location)) as library:
            state.update((name, library.get_tensor(name)) for name in rest)
    return state, metadata


__all__ = ["read_into"]
