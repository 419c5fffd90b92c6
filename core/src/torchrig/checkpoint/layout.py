"""Where checkpoints live on disk, and how one is recognised as committed.

A checkpoint is a directory holding a manifest (:data:`MANIFEST_NAME`, see :mod:`manifest`). It
is written as a hidden sibling ``.<name>.tmp-<token>`` (owned, see :mod:`temporaries`) and
renamed into place by rank 0 once every rank's files are on disk: **the rename is the commit
point**. A directory without a valid manifest, or with ``.tmp-`` in its name, was never
committed (or is damaged) and is never loaded. ``latest`` (a one-line text
file in the checkpoints root) names the newest committed checkpoint for people and tools;
loading does not need it — it picks the committed checkpoint with the highest ``sequence``, so
a kill between the rename and the ``latest`` update loses nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import secrets
from collections.abc import Iterator
from typing import Any

from torchrig.checkpoint import temporaries
from torchrig.checkpoint.files import CheckpointError, fsync_path
from torchrig.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST_NAME,
    ManifestProblem,
    check_file,
    has_manifest_file,
    load_manifest,
    read_manifest,
    unlisted_files,
    verify,
    write_manifest,
)

LATEST_NAME = "latest"
AUTOMATIC_PREFIX = "checkpoint_"
_AUTOMATIC = re.compile(rf"^{AUTOMATIC_PREFIX}(\d+)$")
#: A name that takes an automatic number: ``checkpoint_<n>`` with anything after, hidden or not.
_TAKEN = re.compile(rf"^\.*{AUTOMATIC_PREFIX}(\d+)(?!\d)")


def numbered(stem: str, index: int, suffix: str) -> str:
    """Accelerate's per-object file names: ``optimizer.bin``, ``optimizer_1.bin``..."""
    return f"{stem}{'' if index == 0 else f'_{index}'}{suffix}"


def temporary_sibling(target: str, kind: str = "tmp") -> str:
    """A hidden sibling path of ``target`` (``.<name>.<kind>-<token>``), not yet owned by anyone."""
    return temporaries.sibling(target, kind)


def automatic_number(name: str) -> int | None:
    """``n`` of an automatically named checkpoint ``checkpoint_<n>``, else None."""
    match = _AUTOMATIC.match(name)
    return int(match[1]) if match else None


def highest_taken_number(root: str) -> int | None:
    """The highest checkpoint number anything under ``root`` already stands for, or None.

    A number is taken by every entry whose name, past leading dots, begins with
    ``checkpoint_<n>`` (``checkpoint_9.bak``, ``.checkpoint_9``, a save in progress), and by every
    committed checkpoint whose manifest records iteration ``n``, whatever its name (a checkpoint
    renamed ``backup``). Automatic numbering continues after it, so a directory renamed by hand
    never makes a later save collide with it."""
    highest = None
    try:
        names = os.listdir(root)
    except OSError:
        return None
    for name in names:
        match = _TAKEN.match(name)
        if match:
            highest = max(highest or 0, int(match[1]))
    for _, _, manifest in scan(root)[0]:
        iteration = manifest.get("iteration")
        if iteration is not None:
            highest = max(highest or 0, iteration)
    return highest


def is_committed(directory: str, *, hidden: bool = False) -> bool:
    """Whether ``directory`` holds a valid manifest (and, unless ``hidden``, is not a hidden working directory)."""
    if not hidden and temporaries.HIDDEN.match(os.path.basename(os.path.normpath(directory))):
        return False
    return read_manifest(directory) is not None


def scan(root: str) -> tuple[list[tuple[int, str, dict[str, Any]]], list[tuple[str, str]]]:
    """``(committed, damaged)`` directly under ``root``: committed as ``(sequence, path, manifest)``,
    oldest first; damaged as ``(path, what is wrong)`` — a directory with a manifest that does not
    validate, or an automatically named ``checkpoint_<n>`` without one (only a commit makes those)."""
    committed, damaged = [], []
    try:
        names = os.listdir(root)
    except OSError:
        return [], []
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(".") or not os.path.isdir(path):
            continue
        if not has_manifest_file(path) and automatic_number(name) is None:
            continue  # not a checkpoint: a folder of the user's
        try:
            manifest = load_manifest(path)
        except ManifestProblem as exc:
            damaged.append((path, str(exc)))
            continue
        committed.append((manifest["sequence"], path, manifest))
    committed.sort(key=lambda item: (item[0], _natural_key(os.path.basename(item[1]))))
    damaged.sort(key=lambda item: _natural_key(os.path.basename(item[0])))
    return committed, damaged


def committed_checkpoints(root: str) -> list[tuple[int, str, dict[str, Any]]]:
    """``(sequence, path, manifest)`` of every committed checkpoint directly under ``root``, oldest first."""
    return scan(root)[0]


def _natural_key(name: str) -> list[Any]:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def latest_checkpoint(root: str, *, skip_damaged: bool = False) -> str | None:
    """The committed checkpoint with the highest sequence under ``root``, or None.

    A damaged checkpoint that is not older than it (by automatic number, else by name) is an
    error naming it and what is wrong, unless ``skip_damaged``: resuming from an older
    checkpoint than the newest one is a decision for the user, never a silent rollback.
    """
    committed, damaged = scan(root)
    newest = committed[-1][1] if committed else None
    if not skip_damaged:
        newer = [(path, problem) for path, problem in damaged if newest is None or _newer(path, newest)]
        if newer:
            path, problem = newer[-1]
            fallback = f"resume from {newest}" if newest else "start without it"
            raise CheckpointError(f"the newest checkpoint {path} is damaged: {problem}. Pass skip_damaged=True to "
                                  f"{fallback} (the damaged directory is kept for inspection; remove it to silence "
                                  "this)")
    return newest


def _newer(path: str, than: str) -> bool:
    mine, theirs = automatic_number(os.path.basename(path)), automatic_number(os.path.basename(than))
    if mine is not None and theirs is not None:
        return mine > theirs
    return _natural_key(os.path.basename(path)) > _natural_key(os.path.basename(than))


def leftovers(root: str) -> Iterator[str]:
    """Hidden working directories under ``root`` (torchrig's or look-alikes; see :mod:`temporaries`)."""
    return temporaries.hidden_directories(root)


def remove_leftovers(root: str) -> list[str]:
    """Remove what dead writers left under ``root`` (never a save in progress, never a directory
    without an owner record); returns what was removed."""
    return temporaries.reclaim(root, is_committed)


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
        temporaries.remove(new)  # ``new`` now holds the old checkpoint
        return
    aside = temporaries.claim(target, "replaced")
    os.rename(target, aside)
    os.rename(new, target)
    temporaries.release(new)
    fsync_path(os.path.dirname(target))
    temporaries.remove(aside)


def delete_checkpoint(path: str) -> None:
    """Rename first (the directory stops counting as committed at once), then remove."""
    aside = temporaries.claim(path, "deleting")
    try:
        os.rename(path, aside)
    except BaseException:
        temporaries.release(aside)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))
    temporaries.remove(aside)


__all__ = [
    "AUTOMATIC_PREFIX",
    "FORMAT",
    "FORMAT_VERSION",
    "LATEST_NAME",
    "MANIFEST_NAME",
    "automatic_number",
    "check_file",
    "committed_checkpoints",
    "delete_checkpoint",
    "exchange",
    "has_manifest_file",
    "highest_taken_number",
    "is_committed",
    "latest_checkpoint",
    "leftovers",
    "load_manifest",
    "numbered",
    "read_manifest",
    "remove_leftovers",
    "replace_directory",
    "scan",
    "temporary_sibling",
    "unlisted_files",
    "verify",
    "write_manifest",
    "write_text_atomic",
]
