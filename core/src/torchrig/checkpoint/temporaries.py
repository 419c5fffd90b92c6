"""Hidden working directories of the commit protocol, and who may remove them.

A save writes into ``.<name>.tmp-<token>``; an overwrite parks the old checkpoint as
``.<name>.replaced-<token>``; rotation renames a checkpoint to ``.<name>.deleting-<token>``
before removing it. Other processes may use the same folder at the same time (an evaluator
loading, a second job saving elsewhere in it), so a directory of this shape is never removed
because of its name: it is removed only when its **owner record** proves that the process
that made it is dead.

The record is a sidecar file ``<directory>.owner`` (JSON: host, boot id, pid, the pid's start
time, run id), written atomically *before* the directory is created or renamed to, and removed
after the directory is gone. A directory is reclaimed when its record names this host and

* another boot of it (``/proc/sys/kernel/random/boot_id`` differs), or
* a pid that no longer exists, or that now belongs to another process (its start time differs), or
* this very process, and the directory is not one of its saves in progress.

Anything else — a record from another host (its liveness cannot be seen from here), a live
owner, no record at all (a look-alike directory that is not torchrig's), an unreadable record —
is left alone. This is how etcd-style stores and PID-file daemons treat locks: ownership plus
liveness, never a name pattern.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import threading
from collections.abc import Iterator
from typing import Any

from torchrig.checkpoint.files import fsync_path
from torchrig.resilience.liveness import process_is_alive

OWNER_SUFFIX = ".owner"
HIDDEN = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|deleting|replaced)-(?P<token>[0-9a-f]+)$")
#: Environment variables that name the run a process belongs to (recorded, for people).
_RUN_ID_VARIABLES = ("TORCHRIG_RUN_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")

#: Hidden directories this process is working in right now (never reclaimed by itself).
_ACTIVE: set[str] = set()
_ACTIVE_LOCK = threading.Lock()


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def process_start_time(pid: int) -> int | None:
    """The pid's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
    except OSError:
        return None
    try:  # the command name (field 2) may hold spaces and parentheses: split after the last ")"
        return int(text[text.rindex(")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def owner_record() -> dict[str, Any]:
    """This process, as the owner of a hidden directory."""
    pid = os.getpid()
    run_id = next((os.environ[name] for name in _RUN_ID_VARIABLES if os.environ.get(name)), None)
    return {"host": socket.gethostname(), "boot_id": _boot_id(), "pid": pid, "start_time": process_start_time(pid),
            "run_id": run_id}


def owner_path(directory: str) -> str:
    return os.path.normpath(directory) + OWNER_SUFFIX


def write_owner(directory: str, record: dict[str, Any] | None = None) -> None:
    """Write ``directory``'s owner record (this process unless ``record``), atomically and durably."""
    path = owner_path(directory)
    tmp = f"{path}.{secrets.token_hex(4)}"
    with open(tmp, "w") as handle:
        json.dump(record if record is not None else owner_record(), handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path))


def read_owner(directory: str) -> dict[str, Any] | None:
    try:
        with open(owner_path(directory)) as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def owner_is_dead(directory: str) -> bool:
    """Whether the record of ``directory`` proves its owner is gone (module docstring)."""
    record = read_owner(directory)
    if record is None or record.get("host") != socket.gethostname():
        return False
    pid, start = record.get("pid"), record.get("start_time")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    boot = _boot_id()
    if boot is not None and record.get("boot_id") not in (None, boot):
        return True
    if pid == os.getpid() and start == process_start_time(pid):
        with _ACTIVE_LOCK:
            return os.path.normpath(directory) not in _ACTIVE
    if not process_is_alive(pid):
        return True
    return start is not None and process_start_time(pid) not in (None, start)


def sibling(target: str, kind: str) -> str:
    parent, name = os.path.split(os.path.abspath(target))
    return os.path.join(parent, f".{name}.{kind}-{secrets.token_hex(6)}")


def claim(target: str, kind: str) -> str:
    """A fresh hidden sibling path of ``target``, owned by this process (record written, path
    registered as in progress); the caller creates or renames to it, then calls :func:`release`."""
    path = sibling(target, kind)
    with _ACTIVE_LOCK:
        _ACTIVE.add(os.path.normpath(path))
    try:
        write_owner(path)
    except BaseException:
        release(path)
        raise
    return path


def release(path: str) -> None:
    """``path`` is gone (committed by a rename, or removed): drop its record."""
    with _ACTIVE_LOCK:
        _ACTIVE.discard(os.path.normpath(path))
    try:
        os.unlink(owner_path(path))
    except FileNotFoundError:
        pass


def remove(path: str) -> None:
    """Remove a hidden directory of this process, then its record."""
    shutil.rmtree(path, ignore_errors=True)
    if not os.path.exists(path):
        release(path)


def hidden_directories(root: str) -> Iterator[str]:
    """Every directory under ``root`` with the shape of a hidden working directory, torchrig's or not."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if HIDDEN.match(name) and os.path.isdir(os.path.join(root, name)):
            yield os.path.join(root, name)


def reclaim(root: str, is_committed: Any) -> list[str]:
    """Remove what dead writers left under ``root``; returns what was removed.

    A ``.replaced-`` directory whose checkpoint is missing (its owner died between the two
    renames of an overwrite without RENAME_EXCHANGE) is renamed back instead: it is the last
    committed state of that checkpoint. ``is_committed(path)`` tells a checkpoint apart.
    """
    removed = []
    for path in hidden_directories(root):
        if not owner_is_dead(path):
            continue
        match = HIDDEN.match(os.path.basename(path))
        assert match is not None
        original = os.path.join(root, match["name"])
        if match["kind"] == "replaced" and not os.path.exists(original) and is_committed(path, hidden=True):
            os.rename(path, original)
            fsync_path(root)
            release(path)
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            release(path)
            removed.append(path)
    try:  # records whose directory is gone (the owner died between the two steps)
        names = os.listdir(root)
    except OSError:
        names = []
    for name in names:
        if name.endswith(OWNER_SUFFIX) and HIDDEN.match(name[:-len(OWNER_SUFFIX)]):
            directory = os.path.join(root, name[:-len(OWNER_SUFFIX)])
            if not os.path.exists(directory) and owner_is_dead(directory):
                release(directory)
    return removed


__all__ = ["HIDDEN", "OWNER_SUFFIX", "claim", "hidden_directories", "owner_is_dead", "owner_record",
           "process_start_time", "read_owner", "reclaim", "release", "remove", "sibling", "write_owner"]
