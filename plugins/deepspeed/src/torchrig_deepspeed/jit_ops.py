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

:func:`build_ops` compiles the ops ahead of a job (``torchrig build-deepspeed-ops``, contributed by
this plugin through ``torchrig.commands``), refusing a stale lock by name instead of waiting on it.
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
from torchrig.plugin import record_status

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


def start_ops(deepspeed: Any) -> list[str]:
    """The ops DeepSpeed needs at ``initialize`` on this machine whatever the config says: only the CPU
    accelerator's comm op is known to be needed there unconditionally; an op asked for by the config
    (cpu_adam...) is reported by the watcher if its build stalls."""
    accelerator = deepspeed.accelerator.get_accelerator()
    if accelerator.device_name() != "cpu":
        return []
    builder = accelerator.create_op_builder(SHM_COMM_BUILDER)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return []
    return [builder.NAME]


def built(deepspeed: Any, name: str) -> bool:
    """Installed prebuilt with DeepSpeed (``DS_BUILD_OPS=1``: imported, not compiled) or in the extensions directory."""
    return bool(deepspeed.git_version_info.installed_ops.get(name, False)) or \
        (extensions_directory() / name / f"{name}.so").exists()


def pending_builds(deepspeed: Any) -> list[str]:
    """The ops DeepSpeed will compile on this machine in ``initialize``: :func:`start_ops` not :func:`built`."""
    return [name for name in start_ops(deepspeed) if not built(deepspeed, name)]


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
            f"{lock.parent.name}, and nothing has been written to {lock.parent} for {idle:.0f} s. {_stale_advice(lock)}")


def _stale_advice(lock: Path) -> str:
    return (f"A compile that was killed leaves this lock behind and every later run waits on it forever: if no other "
            f"process is compiling {lock.parent.name}, delete the lock (rm {lock}) and start again, or build the op "
            f"first with `{BUILD_COMMAND}`")


#: The command that compiles the ops ahead of a job (:func:`build_ops`).
BUILD_COMMAND = "torchrig build-deepspeed-ops"


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
                record_status(waiting=message)

    def __enter__(self) -> LockWatcher:
        self.thread.start()
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        if self.reported and kind is None:  # stopped while waiting (a signal, an error): the record stays
            record_status(waiting=None)


@contextlib.contextmanager
def watching_jit_builds(deepspeed: Any, *, rank: int, local_rank: int, patience: float) -> Iterator[None]:
    """Around a DeepSpeed call that may JIT-compile ops: announce what will be compiled (once per
    node) and report a wait on a stalled compile lock (see the module docstring)."""
    directory = extensions_directory()
    pending = pending_builds(deepspeed)
    if pending and local_rank == 0:
        print(f"torchrig deepspeed: DeepSpeed compiles its op {', '.join(pending)} on its first use on this machine "
              f"(a minute or more on a few cores; nothing is printed while it compiles), into {directory}; later "
              f"runs reuse it. To build it ahead of a job: `{BUILD_COMMAND}` (with the same TORCH_EXTENSIONS_DIR)",
              file=sys.stderr, flush=True)
    with LockWatcher(rank, directory, patience):
        yield


def op_builders() -> dict[str, str]:
    """DeepSpeed's op names (as ``ds_report`` lists them) -> their builder class names."""
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    return {name: type(builder).__name__ for name, builder in ALL_OPS.items() if name != "deepspeed_not_implemented"}


class BuildError(Exception):
    """An op cannot be built now; ``code`` is the exit status (2: a wrong name, 1: the machine's state)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def build_ops(deepspeed: Any, names: list[str], patience: float, say: Any = print) -> list[str]:
    """Compile DeepSpeed's ops ``names`` (none given: the ones a run on this machine compiles at start,
    :func:`pending_builds`) into :func:`extensions_directory` now, saying what and where; the built
    ones are skipped. A lock of one of them left idle for ``patience`` seconds (a killed compile) is a
    :class:`BuildError` naming it — torch would wait on it forever. Returns the ops compiled."""
    directory = extensions_directory()
    accelerator = deepspeed.accelerator.get_accelerator()
    known = op_builders()
    unknown = [name for name in names if name not in known]
    if unknown:
        raise BuildError(f"unknown DeepSpeed op(s) {', '.join(unknown)}; DeepSpeed's ops: {', '.join(sorted(known))}", 2)
    wanted = names or start_ops(deepspeed)
    if not wanted:
        say(f"nothing to build: DeepSpeed's {accelerator.device_name()} accelerator compiles no op at start; name "
            "the ops a config asks for to build them (e.g. cpu_adam)")
        return []
    compiled = []
    for name in wanted:
        builder = accelerator.create_op_builder(known[name])
        if builder is None or not builder.is_compatible():
            raise BuildError(f"DeepSpeed's op {name} cannot be built for its {accelerator.device_name()} accelerator "
                             "on this machine (see `ds_report`)", 1)
        target = directory / name / f"{name}.so"
        if built(deepspeed, name):
            say(f"{name}: built already ({target if target.exists() else 'installed with DeepSpeed'})")
            continue
        lock = directory / name / LOCK_NAME
        stalled = dict(stalled_locks(directory, patience, time.time()))
        if lock in stalled:
            raise BuildError(f"{lock} has been left for {stalled[lock]:.0f} s with nothing written beside it. "
                             f"{_stale_advice(lock).replace(f', or build the op first with `{BUILD_COMMAND}`', '')}", 1)
        if lock.exists():
            say(f"{name}: another process is compiling it ({lock}); waiting for it")
        say(f"{name}: compiling into {directory / name} (a minute or more on a few cores) ...", flush=True)
        started = time.monotonic()
        builder.load(verbose=False)
        say(f"{name}: built in {time.monotonic() - started:.0f} s: {target}")
        compiled.append(name)
    return compiled


__all__ = ["BUILD_COMMAND", "BuildError", "LockWatcher", "build_ops", "built", "extensions_directory", "op_builders",
           "start_ops", "pending_builds", "stall_message", "stalled_locks", "watching_jit_builds"]
