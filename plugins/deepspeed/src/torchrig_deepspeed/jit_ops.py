"""DeepSpeed's just-in-time compiled ops, made visible.

DeepSpeed compiles some of its C++ ops with torch's ``cpp_extension`` the first time a process
needs them — on CPU its shared-memory collectives (``deepspeed_shm_comm``) as soon as its comm
backend starts, inside ``deepspeed.initialize`` — and says nothing while it does (a minute on two
cores, ten on a loaded machine). torch serialises such a build with a lock file in the op's build
directory and waits, without a timeout or a word, while that file exists: a compile that was
killed leaves the file behind, and every later run then waits forever.

:func:`watching_jit_builds` wraps the DeepSpeed call that may compile. Before it, every node's
first local rank says which op will be compiled, and where. During it, a watcher thread looks at
the lock files under torch's extensions directory: a rank that has been waiting on a lock while
nothing in that build directory changed for ``jit_lock_warning_seconds`` is told on stderr, and
the wait is recorded in the rank's status file (``waiting``), so that the launcher's summary of a
stopped run names the lock file and how to clear it. The wait itself is left alone: the lock may
belong to a compile that is still running somewhere (a shared file system).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.cpp_extension import get_default_build_root
from torchrig import run_status

#: The op DeepSpeed's CPU accelerator compiles when its comm backend starts.
SHM_COMM_BUILDER = "ShareMemCommBuilder"
#: What torch's ``FileBaton`` names the lock of an extension build.
LOCK_NAME = "lock"


def extensions_directory() -> Path:
    """Where torch builds this interpreter's extensions — the directory ``cpp_extension`` uses:
    ``$TORCH_EXTENSIONS_DIR`` as it is, else torch's default root /
    ``py<major><minor>_<cpu|cuXYZ>``."""
    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    if chosen:
        return Path(chosen)
    cuda = torch.version.cuda
    flavour = "cpu" if cuda is None else f"cu{cuda.replace('.', '')}"
    return Path(get_default_build_root()) / f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}"


def pending_builds(deepspeed: Any) -> list[str]:
    """The ops DeepSpeed will compile on this machine in ``initialize``: neither installed
    prebuilt nor already in the extensions directory. Only the CPU accelerator's comm op is
    known to be compiled there unconditionally; an op asked for by the config (cpu_adam...) is
    reported by the watcher if its build stalls."""
    accelerator = deepspeed.accelerator.get_accelerator()
    if accelerator.device_name() != "cpu":
        return []
    builder = accelerator.create_op_builder(SHM_COMM_BUILDER)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return []
    name = builder.NAME
    if deepspeed.git_version_info.installed_ops.get(name, False):  # built into the wheel (DS_BUILD_OPS=1): imported, not compiled
        return []
    built = extensions_directory() / name / f"{name}.so"
    return [] if built.exists() else [name]


def stalled_locks(directory: Path, patience: float, now: float) -> list[tuple[Path, float]]:
    """Lock files under ``directory`` whose build directory has not changed for ``patience``
    seconds (a compiling build writes its ninja files and objects there): ``(lock, idle seconds)``."""
    found = []
    for lock in directory.glob(f"*/{LOCK_NAME}"):
        try:
            newest = max(entry.stat().st_mtime for entry in lock.parent.iterdir())
        except (OSError, ValueError):  # vanished between the listing and the stat: the build moved on
            continue
        if now - newest >= patience:
            found.append((lock, now - newest))
    return found


def stall_message(rank: int, lock: Path, idle: float) -> str:
    return (f"rank {rank} is waiting on {lock}: the lock of torch's JIT compile of DeepSpeed's op "
            f"{lock.parent.name}, and nothing has been written to {lock.parent} for {idle:.0f} s. A compile that was "
            f"killed leaves this lock behind and every later run waits on it forever: if no other process is compiling "
            f"{lock.parent.name}, delete the lock (rm {lock}) and start again")


class LockWatcher:
    """A daemon thread that reports each stalled lock once, then clears the record on exit."""

    def __init__(self, rank: int, directory: Path, patience: float) -> None:
        self.rank, self.directory, self.patience = rank, directory, patience
        self.reported: set[Path] = set()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="torchrig-deepspeed-jit-watch", daemon=True)

    def _watch(self) -> None:
        interval = min(5.0, max(0.2, self.patience / 4))
        while not self.stop.wait(interval):
            for lock, idle in stalled_locks(self.directory, self.patience, time.time()):
                if lock in self.reported:
                    continue
                self.reported.add(lock)
                message = stall_message(self.rank, lock, idle)
                print(f"torchrig deepspeed: {message}", file=sys.stderr, flush=True)
                run_status.record(waiting=message)

    def __enter__(self) -> LockWatcher:
        self.thread.start()
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        if self.reported and kind is None:  # stopped while waiting (a signal, an error): the record stays
            run_status.record(waiting=None)


@contextlib.contextmanager
def watching_jit_builds(deepspeed: Any, *, rank: int, local_rank: int, patience: float) -> Iterator[None]:
    """Around a DeepSpeed call that may JIT-compile ops: announce what will be compiled (once per
    node) and report a wait on a stalled compile lock (see the module docstring)."""
    directory = extensions_directory()
    pending = pending_builds(deepspeed)
    if pending and local_rank == 0:
        print(f"torchrig deepspeed: DeepSpeed compiles its op {', '.join(pending)} on its first use on this machine "
              f"(a minute or more on a few cores; nothing is printed while it compiles), into {directory}; later "
              "runs reuse it. To build it ahead of a job, run one DeepSpeed process once (e.g. `torchrig test "
              "--use_deepspeed`), or point TORCH_EXTENSIONS_DIR at a directory that keeps it",
              file=sys.stderr, flush=True)
    with LockWatcher(rank, directory, patience):
        yield


__all__ = ["LockWatcher", "extensions_directory", "pending_builds", "stall_message", "stalled_locks", "watching_jit_builds"]
