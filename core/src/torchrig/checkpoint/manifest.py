"""The manifest of a checkpoint: read, validated field by field, and checked against the disk.

A manifest is untrusted input (a damaged disk, a checkpoint from someone else): every field the
loader uses is type-checked here, and a wrong one is a :class:`CheckpointError` naming the file
and the field, never a raw ``KeyError``/``TypeError`` from deeper down.

:func:`verify` is what loading relies on (docs/checkpoints.md, "What verification guarantees"):
every listed path is relative, stays inside the checkpoint after resolving symlinks, is a
regular file (not a device, FIFO or symlink) and has its recorded size — all checked with
``lstat`` before any file is opened — and no file in the checkpoint is missing from the
manifest. With ``hashes=True`` every file's sha256 must match; a checkpoint saved without hashes
cannot be verified, which is an error rather than a silent pass.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from typing import Any

from torchrig.checkpoint.files import CheckpointError, FileRecord, fsync_path, hash_file

MANIFEST_NAME = "torchrig_checkpoint.json"
FORMAT = "torchrig-checkpoint"
FORMAT_VERSION = 1
#: A manifest is small (one entry per file): anything larger is not one.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
_HEX = frozenset("0123456789abcdef")


class ManifestProblem(CheckpointError):
    """A checkpoint directory whose manifest is missing, unreadable or malformed."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Top-level fields: (accepted check, what it must be). Absent optional fields are fine.
_FIELDS: dict[str, tuple[Any, str]] = {
    "format_version": (_is_int, "an integer"),
    "sequence": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "iteration": (lambda v: v is None or (_is_int(v) and v >= 0), "a non-negative integer or null"),
    "accumulation_step": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
    "world_size": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "num_nodes": (lambda v: _is_int(v) and v >= 1, "a positive integer"),
    "strategy": (lambda v: v is None or isinstance(v, str), "a string"),
    "layout": (lambda v: isinstance(v, dict) and (v.get("mesh") is None or (isinstance(v["mesh"], dict) and all(
        _is_int(size) and size >= 1 for size in v["mesh"].values()))), "an object (mesh: axis -> positive size)"),
    "hashes": (lambda v: isinstance(v, bool), "true or false"),
    "fingerprint": (lambda v: isinstance(v, dict), "an object"),
    "contents": (lambda v: isinstance(v, dict), "an object"),
    "files": (lambda v: isinstance(v, list), "a list"),
}


def _problem(path: str, field: str, expected: str, value: Any) -> ManifestProblem:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ManifestProblem(f"{path}: field {field} must be {expected}, not {shown} (the manifest is damaged or was "
                           "not written by torchrig)")


def validate(data: Any, path: str) -> dict[str, Any]:
    """``data`` as a manifest, or :class:`ManifestProblem` naming ``path`` and the bad field."""
    if not isinstance(data, dict):
        raise ManifestProblem(f"{path}: a manifest is a JSON object, not {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise _problem(path, "format", repr(FORMAT), data.get("format", "<absent>"))
    for field in ("sequence", "world_size", "files"):
        if field not in data:
            raise _problem(path, field, _FIELDS[field][1], "<absent>")
    for field, (check, expected) in _FIELDS.items():
        if field in data and not check(data[field]):
            raise _problem(path, field, expected, data[field])
    for index, entry in enumerate(data["files"]):
        where = f"files[{index}]"
        if not isinstance(entry, dict):
            raise _problem(path, where, "an object", entry)
        checks = {"path": (lambda v: isinstance(v, str) and v != "" and "\x00" not in v,
                           "a non-empty string without a NUL byte (no file name holds one)"),
                  "size": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
                  "rank": (lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
                  "sha256": (lambda v: v is None or (isinstance(v, str) and len(v) == 64 and set(v) <= _HEX),
                             "64 lowercase hex digits")}
        for key, (check, expected) in checks.items():
            if key in ("path", "size") and key not in entry:
                raise _problem(path, f"{where}.{key}", expected, "<absent>")
            if key in entry and not check(entry[key]):
                raise _problem(path, f"{where}.{key}", expected, entry[key])
    for key, value in data.get("contents", {}).items():
        if not (_is_int(value) and value >= 0):
            raise _problem(path, f"contents.{key}", "a non-negative integer", value)
    fingerprint = data.get("fingerprint", {})
    for key, (check, expected) in {"config": (lambda v: isinstance(v, dict), "an object"),
                                   "data_order": (lambda v: v is None or (isinstance(v, list) and all(
                                       isinstance(d, dict) for d in v)), "a list of objects")}.items():
        if key in fingerprint and not check(fingerprint[key]):
            raise _problem(path, f"fingerprint.{key}", expected, fingerprint[key])
    return data


def load_manifest(directory: str) -> dict[str, Any]:
    """The validated manifest of ``directory``; :class:`ManifestProblem` says what is wrong."""
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ManifestProblem(f"{directory} has no manifest ({MANIFEST_NAME}): it was damaged or never "
                              "committed") from None
    except OSError as exc:
        raise ManifestProblem(f"{path} is unreadable: {exc.strerror or exc}") from exc
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_MANIFEST_BYTES:
        raise ManifestProblem(f"{path} is unreadable: not a regular file of at most {MAX_MANIFEST_BYTES} bytes")
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise ManifestProblem(f"{path} is unreadable (truncated or not JSON: {exc})") from exc
    return validate(data, path)


def read_manifest(directory: str) -> dict[str, Any] | None:
    """The manifest of a committed checkpoint, or None (no manifest, unreadable, malformed, not ours)."""
    try:
        return load_manifest(directory)
    except ManifestProblem:
        return None


def has_manifest_file(directory: str) -> bool:
    return os.path.lexists(os.path.join(directory, MANIFEST_NAME))


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    path = os.path.join(directory, MANIFEST_NAME)
    with open(path, "w") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True, default=str)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    fsync_path(directory)


def check_file(directory: str, relative: str, size: int) -> str | None:
    """What is wrong with one listed file (``None``: a regular file of ``size`` bytes inside the
    checkpoint). Nothing is opened."""
    parts = relative.replace("\\", "/").split("/")
    if os.path.isabs(relative) or ".." in parts or "" in parts or "." in parts or "\x00" in relative:
        raise CheckpointError(f"checkpoint {directory}: the manifest lists {relative!r}, which is not a plain path "
                              "inside the checkpoint; the manifest is damaged or hostile")
    path = os.path.join(directory, relative)
    try:
        info = os.lstat(path)
    except OSError:
        return f"{relative}: missing"
    if not stat.S_ISREG(info.st_mode):
        return f"{relative}: not a regular file (a symlink, device, FIFO or directory)"
    root = os.path.realpath(directory)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise CheckpointError(f"checkpoint {directory}: {relative!r} resolves outside the checkpoint (through a "
                              "symlinked directory); only files inside the checkpoint are loaded")
    if info.st_size != size:
        return f"{relative}: {info.st_size} bytes on disk, {size} in the manifest"
    return None


def unlisted_files(directory: str, listed: set[str]) -> list[str]:
    """Files in ``directory`` the manifest does not name (never loaded: refused)."""
    found = []
    for dirpath, _, names in os.walk(directory):
        for name in names:
            relative = os.path.relpath(os.path.join(dirpath, name), directory).replace(os.sep, "/")
            if relative != MANIFEST_NAME and relative not in listed:
                found.append(relative)
    return sorted(found)


def verify(directory: str, manifest: Mapping[str, Any], *, hashes: bool = False,
           ranks: set[int] | None = None) -> None:
    """Check ``directory`` against its manifest (module docstring). ``ranks`` limits the check to
    files written by those ranks (nodes that do not share a disk)."""
    records = [FileRecord.from_json(entry) for entry in manifest.get("files", [])]
    if hashes and (not manifest.get("hashes") or any(r.sha256 is None for r in records)):
        raise CheckpointError(f"cannot verify the hashes of checkpoint {directory}: it was saved without hashes "
                              "(save_state(..., hashes=True) or ProjectConfiguration(checkpoint_hashes=True) records "
                              "them); load it without verify_hashes=True, or re-save it with hashes")
    problems = []
    for record in records:
        if ranks is not None and record.rank not in ranks:
            continue
        problem = check_file(directory, record.path, record.size)
        if problem is None and hashes and hash_file(os.path.join(directory, record.path)) != record.sha256:
            problem = f"{record.path}: sha256 differs from the manifest"
        if problem is not None:
            problems.append(problem)
    if ranks is None:
        problems += [f"{name}: not in the manifest (a file nobody vouches for is never loaded)"
                     for name in unlisted_files(directory, {r.path for r in records})]
    if problems:
        listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"checkpoint {directory} is damaged ({listed}); load an older checkpoint")


__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST_NAME", "ManifestProblem", "check_file",
           "has_manifest_file", "load_manifest", "read_manifest", "unlisted_files", "validate", "verify",
           "write_manifest"]
