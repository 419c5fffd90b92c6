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

The whole header is checked by the library's own rules (:mod:`~torchrig.checkpoint.safetensors_header`:
JSON, dtypes, shapes, contiguous non-overlapping offsets that cover the file exactly, sizes that
agree) before a single byte lands in a live tensor, so a file the library would refuse is refused
with the live state untouched. Format: https://github.com/huggingface/safetensors#format.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from safetensors import safe_open

from torchrig.checkpoint.files import CheckpointError
from torchrig.checkpoint.hashed_safetensors import DTYPE_CODES
from torchrig.checkpoint.safetensors_header import Header, TensorEntry, read_header

#: Direct reads are cut into pieces of this size (Linux transfers at most 0x7FFFF000 bytes per
#: call) and spread over up to :data:`_THREADS` threads: a page-cache copy runs at the speed of one
#: core, and loading is the only work while it runs.
_PIECE = 32 << 20
_THREADS = min(4, os.cpu_count() or 1)


def _fits(target: Any, entry: TensorEntry) -> bool:
    return (isinstance(target, torch.Tensor) and target.device.type == "cpu" and target.layout == torch.strided
            and DTYPE_CODES.get(target.dtype) == entry.dtype and list(target.shape) == entry.shape
            and target.is_contiguous() and not target.is_conj() and not target.is_neg())


def _pieces(direct: Mapping[str, torch.Tensor], header: Header) -> list[tuple[memoryview, int, str]]:
    """(destination bytes, file offset, tensor name) for every direct read, in pieces of at most
    :data:`_PIECE` bytes so that threads share the work evenly."""
    pieces = []
    for name, target in direct.items():
        if not target.numel():
            continue
        view = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())
        base = header.data_start + header.tensors[name].begin
        pieces.extend((view[at:at + _PIECE], base + at, name) for at in range(0, view.nbytes, _PIECE))
    return pieces


def _read_piece(fd: int, view: memoryview, offset: int, name: str, path: str) -> None:
    done = 0
    while done < view.nbytes:
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise CheckpointError(f"{path} ended while reading tensor {name!r} (at byte {offset + done})")
        done += count


def _library_reads(path: str, names: list[str], location: Any) -> dict[str, torch.Tensor]:
    """``names`` read by the library, into new tensors (a dtype torch cannot hold is refused here)."""
    if not names:
        return {}
    try:
        with safe_open(path, framework="pt", device=str(location)) as library:
            return {name: library.get_tensor(name) for name in names}
    except Exception as exc:  # SafetensorError, or torch's for a dtype it lacks
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc


def read_into(path: str, targets: Mapping[str, Any],
              location: Any = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of the safetensors file ``path`` by name, and the file's metadata: for a name in
    ``targets`` whose tensor matches the entry exactly, that tensor itself, its bytes now read
    from the file; every other entry read by the library onto ``location``.

    Order: the header is checked, then the library reads what goes to new tensors, and only then
    do bytes land in live tensors — so any refusal leaves the live state untouched."""
    with open(path, "rb", buffering=0) as handle:
        fd = handle.fileno()
        header = read_header(fd, path)
        direct = {} if str(location) != "cpu" else {
            name: targets[name] for name, entry in header.tensors.items() if _fits(targets.get(name), entry)}
        state = _library_reads(path, [name for name in header.tensors if name not in direct], location)
        pieces = _pieces(direct, header)
        if len(pieces) > 1 and _THREADS > 1:  # the kernel copies release the GIL: one per core
            with ThreadPoolExecutor(_THREADS, thread_name_prefix="torchrig-load") as pool:
                list(pool.map(lambda piece: _read_piece(fd, *piece, path), pieces))
        else:
            for piece in pieces:
                _read_piece(fd, *piece, path)
    state.update(direct)
    return state, dict(header.metadata)


__all__ = ["read_into"]
