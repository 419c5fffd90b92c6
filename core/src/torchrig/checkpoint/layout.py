"""Where checkpoints live on disk, and how one is recognised as committed.

A checkpoint is a directory holding a manifest (:data:`MANIFEST_NAME`). It is written as a
hidden sibling ``.<name>.tmp-<token>`` and renamed into place by rank 0 once every rank's files
are on disk: **the rename is the commit point**. A directory without a manifest, or with
``.tmp-`` in its name, was never committed and is never loaded. ``latest`` (a one-line text
file in the checkpoints root) names the newest committed checkpoint for people and tools;
loading does not need it — it picks the committed checkpoint with the highest ``sequence``, so
a kill between the rename and the ``latest`` update loses nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from typing import Any

from torchrig.checkpoint.files import CheckpointError, FileRecord, fsync_path, hash_file

MANIFEST_NAME = "torchrig_checkpoint.json"
FORMAT = "torchrig-checkpoint"
FORMAT_VERSION = 1
LATEST_NAME = "latest"
AUTOMATIC_PREFIX = "checkpoint_"
_HIDDEN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|deleting|replaced)-(?P<token>[0-9a-f]+)$")


def numbered(stem: str, index: int, suffix: str) -> str:
    """Accelerate's per-object file names: ``optimizer.bin``, ``optimizer_1.bin``..."""
    return f"{stem}{'' if index == 0 else f'_{index}'}{suffix}"


def temporary_sibling(target: str, kind: str = "tmp", token: str | None = None) -> str:
    parent, name = os.path.split(os.path.abspath(target))
    return os.path.join(parent, f".{name}.{kind}-{token or secrets.token_hex(6)}")


def read_manifest(directory: str) -> dict[str, Any] | None:
    """The manifest of a committed checkpoint, or None (no manifest, unreadable, not ours)."""
    try:
        with open(os.path.join(directory, MANIFEST_NAME)) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    return data


def is_committed(directory: str) -> bool:
    return not _HIDDEN.match(os.path.basename(os.path.normpath(directory))) and read_manifest(directory) is not None


def committed_checkpoints(root: str) -> list[tuple[int, str, dict[str, Any]]]:
    """``(sequence, path, manifest)`` of every committed checkpoint directly under ``root``, oldest first."""
    found = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        if name.startswith("."):
            continue
        path = os.path.join(root, name)
        manifest = read_manifest(path) if os.path.isdir(path) else None
        if manifest is not None:
            found.append((int(manifest.get("sequence", 0)), path, manifest))
    found.sort(key=lambda item: (item[0], _natural_key(os.path.basename(item[1]))))
    return found


def _natural_key(name: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def latest_checkpoint(root: str) -> str | None:
    found = committed_checkpoints(root)
    return found[-1][1] if found else None


def leftovers(root: str) -> Iterator[str]:
    """Uncommitted temporary, half-deleted and replaced directories under ``root``."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if _HIDDEN.match(name):
            yield os.path.join(root, name)


def remove_leftovers(root: str) -> list[str]:
    """Remove what interrupted saves left under ``root``; returns what was removed.

    A ``.replaced-`` directory whose checkpoint is missing (a kill between the two renames of
    an overwrite without RENAME_EXCHANGE) is renamed back instead: it is the last committed
    state of that checkpoint.
    """
    removed = []
    for path in leftovers(root):
        match = _HIDDEN.match(os.path.basename(path))
        assert match is not None
        original = os.path.join(root, match["name"])
        if match["kind"] == "replaced" and not os.path.exists(original) and read_manifest(path) is not None:
            os.rename(path, original)
            fsync_path(root)
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def write_text_atomic(path: str, text: str, *, durable: bool = True) -> None:
    """Replace ``path`` with ``text`` in one rename: readers see the old or the new text. With
    ``durable=False`` nothing is fsynced (a killed process still leaves one of the two; only a
    power loss can roll it back) — for files nothing depends on, like the ``latest`` pointer."""
    tmp = f"{path}.tmp-{secrets.token_hex(4)}"
    with open(tmp, "w") as handle:
        handle.write(text)
        if durable:
            handle.flush()
            os.fsync(handle.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_path(os.path.dirname(os.path.abspath(path)))


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    path = os.path.join(directory, MANIFEST_NAME)
    with open(path, "w") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True, default=str)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    fsync_path(directory)


def verify(directory: str, manifest: dict[str, Any], *, hashes: bool = False, ranks: set[int] | None = None) -> None:
    """Check that every manifested file exists with its recorded size (and hash, if asked and
    recorded). ``ranks`` limits the check to files written by those ranks (non-shared disks)."""
    problems = []
    for entry in manifest.get("files", []):
        record = FileRecord.from_json(entry)
        if ranks is not None and record.rank not in ranks:
            continue
        path = os.path.join(directory, record.path)
        try:
            size = os.path.getsize(path)
        except OSError:
            problems.append(f"{record.path}: missing")
            continue
        if size != record.size:
            problems.append(f"{record.path}: {size} bytes on disk, {record.size} in the manifest")
        elif hashes and record.sha256 and hash_file(path) != record.sha256:
            problems.append(f"{record.path}: sha256 differs from the manifest")
    if problems:
        listed = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise CheckpointError(f"checkpoint {directory} is damaged ({listed}); load an older checkpoint")


# -- moving directories ------------------------------------------------------------------------

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = libc.renameat2
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return function


def exchange(new: str, old: str) -> bool:
    """Atomically swap two directories (Linux ``renameat2(RENAME_EXCHANGE)``). False when the
    system or filesystem cannot, so the caller falls back to two renames."""
    function = _renameat2()
    if function is None:
        return False
    if function(_AT_FDCWD, os.fsencode(new), _AT_FDCWD, os.fsencode(old), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), old)


def replace_directory(new: str, target: str) -> None:
    """Put ``new`` at ``target``, where a committed checkpoint already is, atomically.

    With RENAME_EXCHANGE the swap is one step; otherwise the old directory is first renamed to a
    hidden ``.replaced-`` sibling (which is never loaded), so a kill in between leaves the new
    checkpoint's temporary directory and the old one's ``.replaced-`` copy, both ignored, and
    the older committed checkpoints as they were.
    """
    if exchange(new, target):
        fsync_path(os.path.dirname(target))
        shutil.rmtree(new, ignore_errors=True)  # ``new`` now holds the old checkpoint
        return
    aside = temporary_sibling(target, "replaced")
    os.rename(target, aside)
    os.rename(new, target)
    fsync_path(os.path.dirname(target))
    shutil.rmtree(aside, ignore_errors=True)


def delete_checkpoint(path: str) -> None:
    """Rename first (the directory stops counting as committed at once), then remove."""
    aside = temporary_sibling(path, "deleting")
    os.rename(path, aside)
    fsync_path(os.path.dirname(os.path.abspath(path)))
    shutil.rmtree(aside, ignore_errors=True)


__all__ = [
    "AUTOMATIC_PREFIX", "FORMAT", "FORMAT_VERSION", "LATEST_NAME", "MANIFEST_NAME", "committed_checkpoints",
    "delete_checkpoint", "exchange", "is_committed", "latest_checkpoint", "leftovers", "numbered", "read_manifest",
    "remove_leftovers", "replace_directory", "temporary_sibling", "verify", "write_manifest", "write_text_atomic",
]
