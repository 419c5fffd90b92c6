"""A safetensors header, checked by the rules the ``safetensors`` library applies — no more, no less.

torchrig reads safetensors files itself (:mod:`~torchrig.checkpoint.direct_read`: straight into
live tensors), so it must refuse exactly what the library refuses: a file the library would not
load must never change a live tensor, and a file the library loads must load. The rules, from
the library's ``SafeTensors::read_metadata`` and ``Metadata::validate`` (safetensors 0.8,
``safetensors/src/tensor.rs``):

* 8 bytes of little-endian header length ``n``; ``n`` at most 100,000,000 and ``8 + n`` within
  the file;
* the header is UTF-8 JSON (serde_json: no NaN/Infinity, no lone surrogate escapes, no number
  out of the double range, at most 127 nested arrays/objects) and a JSON object;
* ``__metadata__`` (at most once) is null or an object of strings; every other key is a tensor
  (a repeated tensor name: the last entry counts, as in the library) whose entry is an object
  with ``dtype``, ``shape`` and ``data_offsets`` exactly once each (other keys ignored), or an
  array of those three in that order;
* ``dtype`` is one of the format's names; ``shape`` a list of unsigned 64-bit integers;
  ``data_offsets`` two of them;
* sorted by offsets, the tensors are contiguous from 0 (no gap, no overlap, ``begin <= end``),
  each one's byte size is elements x bit size / 8 (whole bytes, no 64-bit overflow), and the
  last one ends exactly where the file does.

Every refusal is a :class:`~torchrig.checkpoint.files.CheckpointError` naming the file and what is
wrong. ``tests/checkpoint/test_safetensors_header.py`` compares the verdicts with the library's
on generated and mutated headers (hypothesis).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from typing import Any, NamedTuple

from torchrig.checkpoint.files import SAFETENSORS_METADATA_KEY as METADATA_KEY
from torchrig.checkpoint.files import CheckpointError

#: The library's limit on the header length (``MAX_HEADER_SIZE``).
MAX_HEADER_BYTES = 100_000_000
#: serde_json refuses a document nested this deep (arrays and objects together).
_MAX_DEPTH = 128
_USIZE_LIMIT = 1 << 64
#: The format's dtype names and their sizes in bits (the library's ``Dtype::bitsize``).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
    "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}
_FIELDS = ("dtype", "shape", "data_offsets")


class TensorEntry(NamedTuple):
    """One tensor of a checked header; ``begin``/``end`` are relative to the data section."""

    dtype: str
    shape: list[int]
    begin: int
    end: int


class Header(NamedTuple):
    """A checked header: the tensors by name, ``__metadata__`` ({} when absent or null), and the
    file offset where the data section starts."""

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int


class _Refused(Exception):
    """What is wrong with a header (becomes a CheckpointError naming the file)."""


class _NotUsize(int):
    """A JSON integer literal that cannot be an unsigned 64-bit value (negative, ``-0``, too big):
    serde reads it as a signed or floating-point number, which a ``usize`` field refuses."""


class _Pairs(list):
    """A JSON object as its key/value pairs, in order, duplicates kept."""


def _parse_int(literal: str) -> int:
    value = int(literal)
    if literal.startswith("-") or value >= _USIZE_LIMIT:
        if value >= _USIZE_LIMIT and math.isinf(float(literal)):
            raise _Refused(f"the number {literal[:30]}... is out of range")
        return _NotUsize(value)
    return value


def _parse_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise _Refused(f"the number {literal[:30]} is out of range")
    return value


def _parse_constant(name: str) -> Any:
    raise _Refused(f"{name} is not JSON")


def _check_text(value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _Refused(f"the string {value[:40]!r} holds a lone surrogate escape") from exc


def _check_depth_and_strings(value: Any, depth: int = 1) -> None:
    """serde_json's nesting limit (``value`` is a container at nesting ``depth``), and strings
    that are real Unicode (Python's json module accepts lone surrogate escapes, serde_json does not)."""
    if depth >= _MAX_DEPTH:
        raise _Refused(f"it nests arrays and objects {_MAX_DEPTH} deep (the library's limit)")
    items = value
    if isinstance(value, _Pairs):
        for key, _ in value:
            _check_text(key)
        items = [item for _, item in value]
    for item in items:
        if isinstance(item, list):
            _check_depth_and_strings(item, depth + 1)
        elif isinstance(item, str):
            _check_text(item)


def _usize(value: Any, what: str) -> int:
    if type(value) is not int:  # bool, float, _NotUsize, str, ... are refused, as serde does
        raise _Refused(f"{what} must be an unsigned 64-bit integer, not {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    if isinstance(value, _Pairs):
        return "an object"
    text = repr(int(value)) if isinstance(value, _NotUsize) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _entry(name: str, value: Any) -> TensorEntry:
    if isinstance(value, _Pairs):
        fields: dict[str, Any] = {}
        for key, item in value:
            if key in _FIELDS:
                if key in fields:
                    raise _Refused(f"tensor {name!r} has the field {key!r} twice")
                fields[key] = item
        missing = [key for key in _FIELDS if key not in fields]
        if missing:
            raise _Refused(f"tensor {name!r} has no {missing[0]!r}")
        dtype, shape, offsets = (fields[key] for key in _FIELDS)
    elif isinstance(value, list) and len(value) == 3:
        dtype, shape, offsets = value
    else:
        raise _Refused(f"the entry of tensor {name!r} must be an object with dtype, shape and data_offsets, not "
                       f"{_shown(value)}")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise _Refused(f"tensor {name!r} has the dtype {_shown(dtype)}, not one of the format's "
                       f"({', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or isinstance(shape, _Pairs):
        raise _Refused(f"tensor {name!r}: shape must be a list, not {_shown(shape)}")
    dims = [_usize(n, f"tensor {name!r}: every dimension of its shape") for n in shape]
    if not isinstance(offsets, list) or isinstance(offsets, _Pairs) or len(offsets) != 2:
        raise _Refused(f"tensor {name!r}: data_offsets must be a list of two integers, not {_shown(offsets)}")
    begin, end = (_usize(n, f"tensor {name!r}: data_offsets") for n in offsets)
    return TensorEntry(dtype, dims, begin, end)


def _metadata(value: Any) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, _Pairs):
        raise _Refused(f"{METADATA_KEY} must be an object of strings, not {_shown(value)}")
    metadata = {}
    for key, item in value:
        if not isinstance(item, str):
            raise _Refused(f"{METADATA_KEY} must map strings to strings, but {key!r} holds {_shown(item)} "
                           f"({type(item).__name__}); the file was not written by a safetensors writer")
        metadata[key] = item
    return metadata


def _byte_size(name: str, entry: TensorEntry) -> int:
    elements = 1
    for dim in entry.shape:  # in order, overflow checked at each step: the library's try_fold
        elements *= dim
        if elements >= _USIZE_LIMIT:
            raise _Refused(f"tensor {name!r}: its shape {entry.shape} overflows 64 bits")
    bits = elements * DTYPE_BITS[entry.dtype]
    if bits >= _USIZE_LIMIT:
        raise _Refused(f"tensor {name!r}: its shape {entry.shape} of {entry.dtype} overflows 64 bits")
    if bits % 8:
        raise _Refused(f"tensor {name!r}: {entry.shape} of {entry.dtype} does not end on a byte boundary")
    return bits // 8


def parse_header(text: bytes, data_size: int) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """The tensors and metadata of a header's JSON bytes, for a data section of ``data_size``
    bytes; ``_Refused`` says what is wrong."""
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Refused(f"the header is not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    try:
        document = json.loads(decoded, object_pairs_hook=_Pairs, parse_int=_parse_int, parse_float=_parse_float,
                              parse_constant=_parse_constant)
    except (ValueError, RecursionError) as exc:
        raise _Refused(f"the header is not JSON ({type(exc).__name__}: {str(exc)[:120]})") from exc
    if not isinstance(document, _Pairs):
        raise _Refused(f"the header must be a JSON object, not {type(document).__name__}")
    _check_depth_and_strings(document)
    tensors: dict[str, TensorEntry] = {}
    metadata: dict[str, str] | None = None
    for key, value in document:
        if key == METADATA_KEY:
            if metadata is not None:
                raise _Refused(f"{METADATA_KEY} appears twice")
            metadata = _metadata(value)
        else:
            tensors[key] = _entry(key, value)  # a repeated name: the last entry counts (the library's HashMap)
    covered = 0
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != covered or entry.end < entry.begin:
            problem = "overlaps the tensor before it" if entry.begin < covered else (
                "leaves a gap after the tensor before it" if entry.begin > covered else "ends before it begins")
            raise _Refused(f"tensor {name!r} has data_offsets [{entry.begin}, {entry.end}], which {problem} (tensors "
                           f"must cover the data contiguously: the next one begins at {covered})")
        covered = entry.end
        size = _byte_size(name, entry)
        if entry.end - entry.begin != size:
            raise _Refused(f"tensor {name!r} ({entry.dtype}, shape {entry.shape}) needs {size} bytes, its data_offsets "
                           f"[{entry.begin}, {entry.end}] hold {entry.end - entry.begin}")
    if covered != data_size:
        raise _Refused(f"its tensors cover {covered} bytes of data, the file holds {data_size} after the header")
    return tensors, metadata or {}


def read_header(fd: int, path: str, size: int | None = None) -> Header:
    """The checked header of the safetensors file open as ``fd`` (``size``: its length, by
    default fstat's). Nothing but the header is read."""
    size = os.fstat(fd).st_size if size is None else size
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        raise CheckpointError(f"{path} is not a safetensors file: {size} bytes, shorter than its header length")
    (length,) = struct.unpack("<Q", raw)
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path} is damaged: its header claims {length} bytes, more than the format's "
                              f"{MAX_HEADER_BYTES}")
    if 8 + length > size:
        raise CheckpointError(f"{path} is damaged: its header claims {length} bytes, the file has {size}")
    try:
        tensors, metadata = parse_header(os.pread(fd, length, 8), size - 8 - length)
    except _Refused as exc:
        raise CheckpointError(f"{path} is not a valid safetensors file: {exc} (damaged, or not written by a "
                              "safetensors writer); load an older checkpoint") from None
    return Header(tensors, metadata, 8 + length)


def check_file(path: str) -> Header:
    """:func:`read_header` of the file at ``path`` (refusals name it)."""
    try:
        with open(path, "rb", buffering=0) as handle:
            return read_header(handle.fileno(), path)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from exc


def entries_as_json(header: Header) -> Mapping[str, Mapping[str, Any]]:
    """The tensor entries in the file's own JSON shape (for messages and tests)."""
    return {name: {"dtype": e.dtype, "shape": e.shape, "data_offsets": [e.begin, e.end]}
            for name, e in header.tensors.items()}


__all__ = ["DTYPE_BITS", "MAX_HEADER_BYTES", "METADATA_KEY", "Header", "TensorEntry", "check_file",
           "entries_as_json", "parse_header", "read_header"]
