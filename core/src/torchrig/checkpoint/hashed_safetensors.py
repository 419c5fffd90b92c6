"""A safetensors file written and hashed at the same time, for ``save_state(hashes=True)``.

``safetensors.torch.save_file`` writes from the tensors' memory into a temporary file that it
renames at the end, so nothing can hash the file while it is written, and hashing it afterwards
(sha256 runs at about the speed of the write) doubles the time of a save. This module writes
the same format (https://github.com/huggingface/safetensors#format: an 8-byte little-endian
header length, a JSON header padded with spaces to a multiple of 8, then every tensor's bytes
at the offsets the header gives) straight from the tensors' memory, while a thread hashes the
same bytes from memory: both release the GIL, so the two run side by side — and the digest is
only awaited when the checkpoint's file list is taken, so one file's hash also overlaps the next
file's write. The file is read back by the library itself
(``safe_open``); the tests check that round trip for every dtype and shape it supports.
Anything it does not handle (a dtype not in the table) goes to the library and is hashed after.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import torch

from torchrig.checkpoint.digests import PendingDigest

#: torch dtype -> safetensors dtype code (the format's table; the library's readers accept each).
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.complex64: "C64",
}


def supported(tensors: Mapping[str, torch.Tensor]) -> bool:
    """Whether every tensor can be written here (strided, of a dtype in :data:`DTYPE_CODES`)."""
    return all(t.dtype in DTYPE_CODES and t.layout == torch.strided for t in tensors.values())


def _byte_view(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def write_hashed(path: str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None) -> PendingDigest:
    """Write ``tensors`` as a safetensors file at ``path``; the returned :class:`PendingDigest`
    (:class:`~torchrig.checkpoint.digests.PendingDigest`) is the file's sha256, computed by a thread from the same bytes while (and after) they are
    written — so the next file's write overlaps this one's hash too.

    The tensors must not change until the digest's ``result()`` returned (``save_state`` asks
    for every digest before it commits, and training does not run in between). Tensors are
    laid out by decreasing element size, then name (the library's order, which keeps every
    tensor aligned to its element size). Not fsynced: the caller does that with the rest of
    the checkpoint."""
    ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    views: list[memoryview] = []
    offset = 0
    for name, tensor in ordered:
        view = _byte_view(tensor) if tensor.numel() else memoryview(b"")
        header[name] = {"dtype": DTYPE_CODES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
        if view.nbytes:
            views.append(view)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    parts = [memoryview(struct.pack("<Q", len(encoded)) + encoded), *views]
    pending = PendingDigest(lambda: parts, path)
    with open(path, "wb") as handle:
        for part in parts:
            handle.write(part)
    return pending


__all__ = ["DTYPE_CODES", "supported", "write_hashed"]
