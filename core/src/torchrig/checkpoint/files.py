"""Durable checkpoint files: written once, fsynced, sized and (optionally) hashed while streaming.

Every file of a checkpoint goes through a :class:`CheckpointWriter` (the core's own state and the
strategies' model and optimizer state) or is recorded with :meth:`CheckpointWriter.record` when a
library wrote it itself (DCP, DeepSpeed). The writer keeps one :class:`FileRecord` per file; the
commit protocol sends them to rank 0, which writes them into the manifest.

Hashes are computed on the bytes as they are written (a separate read pass costs ~25% of a
save), and only when asked for. With ``deferred=True`` (asynchronous saves) the writer copies
the state to CPU memory at once and writes it later from a background thread: the training
loop waits only for the copy.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from torchrig.checkpoint import faults
from torchrig.checkpoint.digests import PendingDigest, file_chunks
from torchrig.errors import TorchrigError

#: Bytes hashed per ``read`` when a file written by a library is hashed afterwards.
#: errno values that mean "the disk (or the quota, or the file-size limit) is full".
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
#: The header key of a safetensors file's own metadata: no tensor may have this name.
SAFETENSORS_METADATA_KEY = "__metadata__"


class CheckpointError(TorchrigError):
    """A checkpoint could not be saved, found, verified or loaded. The message names the
    directory, the file or rank, what is wrong and what to do."""


def describe(exc: BaseException) -> str:
    """One line for a failed save or load: a CheckpointError's own message, else the type too."""
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


@attrs.frozen
class FileRecord:
    """One file of a checkpoint, relative to the checkpoint directory."""

    path: str
    size: int
    sha256: str | None = None
    rank: int = 0

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"path": self.path, "size": self.size, "rank": self.rank}
        if self.sha256 is not None:
            data["sha256"] = self.sha256
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FileRecord:
        return cls(path=str(data["path"]), size=int(data["size"]), sha256=data.get("sha256"), rank=int(data.get("rank", 0)))


def describe_os_error(exc: OSError, path: str) -> str:
    """A message for a failed write that says what to do about it."""
    if exc.errno in _NO_SPACE:
        return (f"no space left while writing {path} ({os.strerror(exc.errno or 0)}); free disk space or lower "
                "total_limit — the previous checkpoint is intact")
    return f"cannot write {path}: {exc.strerror or exc}"


def describe_write_failure(exc: BaseException, path: str) -> str:
    """Like :func:`describe_os_error` for errors libraries raise with the OS error in the text
    (safetensors: "I/O error: ... (os error 28)"; torch.save: "... error code: 28")."""
    if isinstance(exc, OSError):
        return describe_os_error(exc, path)
    text = str(exc)
    match = re.search(r"os error (\d+)|error code:? (\d+)", text)
    if match:
        code = int(match.group(1) or match.group(2))
        return describe_os_error(OSError(code, os.strerror(code)), path)
    return f"cannot write {path}: {type(exc).__name__}: {text}"


def fsync_path(path: str) -> None:
    """fsync a file or a directory (a directory's fsync makes its entries — renames — durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _StreamingFile:
    """A binary file that hashes what passes through ``write`` and may die midway (faults)."""

    def __init__(self, path: str, hashing: bool, fault_phase: str | None, rank: int) -> None:
        self._rank = rank
        self._handle = open(path, "wb")
        self._hash = hashlib.sha256() if hashing else None
        self._fault_phase = fault_phase
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._fault_phase is not None and self.size > 0:
            faults.point(self._fault_phase, self._rank)  # a kill with part of the file on disk
            self._fault_phase = None
        if self._hash is not None:
            self._hash.update(view)
        written = self._handle.write(view)
        self.size += len(view)
        return written

    def flush(self) -> None:
        self._handle.flush()

    def close(self) -> str | None:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        return self._hash.hexdigest() if self._hash is not None else None

    def abort(self) -> None:
        self._handle.close()


def hash_file(path: str) -> str:
    digest = hashlib.sha256()
    for chunk in file_chunks(path):
        digest.update(chunk)
    return digest.hexdigest()


def _snapshot(obj: Any, staging: dict[str, Any], key: str) -> Any:
    """A copy of ``obj`` whose tensors live in CPU memory and no longer change with training.

    Tensors are copied into ``staging`` buffers kept from the previous asynchronous save when
    shape and dtype match: fresh memory would page-fault on first touch, which costs more than
    the copy itself.
    """
    import torch

    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:  # sparse and other layouts: a plain copy
            return obj.detach().to("cpu", copy=True)
        buffer = staging.get(key)
        if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
            buffer = staging[key] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
        buffer.copy_(obj.detach())
        return buffer
    if isinstance(obj, Mapping):
        return {k: _snapshot(v, staging, f"{key}/{k}") for k, v in obj.items()}
    if isinstance(obj, list):
        return [_snapshot(v, staging, f"{key}/{i}") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        items = [_snapshot(v, staging, f"{key}/{i}") for i, v in enumerate(obj)]
        if hasattr(obj, "_fields"):
            return type(obj)(*items)
        return tuple(items) if type(obj) is tuple else type(obj)(items)  # torch.Size stays a torch.Size
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return obj
    try:  # an object the state holds (an engine's loss scaler) may change before the background writes it
        return copy.deepcopy(obj)
    except Exception:  # noqa: BLE001 — what cannot be copied is written as it is then
        return obj


class CheckpointWriter:
    """Writes this rank's files of one checkpoint into ``directory`` and remembers them.

    ``safe_serialization`` says whether model weights should be safetensors (strategies read
    it); ``hashing`` turns on streaming sha256; ``deferred`` makes every write a CPU snapshot
    now (into ``staging`` buffers) and a file later (:meth:`flush`), and every
    :meth:`library_write` a call later; ``background_group`` is the process group those later
    calls use for their collectives (its own gloo group: training keeps the default one).
    """

    def __init__(self, directory: str, rank: int, *, hashing: bool = False, safe_serialization: bool = True,
                 deferred: bool = False, staging: dict[str, Any] | None = None,
                 background_group: Any = None) -> None:
        self.directory = directory
        self.rank = rank
        self.hashing = hashing
        self.safe_serialization = safe_serialization
        self.deferred = deferred
        #: CPU buffers of deferred writes, reused by the next asynchronous save (see _snapshot).
        self.staging = staging if staging is not None else {}
        #: The group of a deferred library write's collectives (None: one process, or synchronous).
        self.background_group = background_group
        self._records: dict[str, FileRecord] = {}
        self._library_writes: list[Callable[[], Sequence[str]]] = []
        self._pending: list[tuple[str, Callable[[Any, Any], None], Any, str | None, Callable[[str, Any], Any] | None]] = []
        self._unsynced: list[str] = []  # written on the fast path, fsynced in records()
        self._hashing: dict[str, Any] = {}  # name -> a digest being computed (.result())  # written on the fast path, hashed in the background
        self._lock = threading.Lock()

    # -- writing ---------------------------------------------------------------------------

    def save_torch(self, obj: Any, name: str, *, fault_phase: str | None = None) -> str:
        """``torch.save`` ``obj`` as ``name`` (relative to the checkpoint directory)."""
        import torch

        return self._write(name, lambda target, value: torch.save(value, target), obj, fault_phase)

    def save_tensors(self, tensors: Mapping[str, Any], name: str, metadata: Mapping[str, str] | None = None,
                     *, fault_phase: str | None = None) -> str:
        """Write a flat name → tensor mapping as a safetensors file."""
        from safetensors.torch import save, save_file

        from torchrig.checkpoint import hashed_safetensors  # imports torch: this module stays torch-free at import

        extra = dict(metadata) if metadata else None

        def write(target: Any, value: Mapping[str, Any]) -> None:
            if isinstance(target, str):
                save_file(dict(value), target, metadata=extra)  # written by Rust, no copy through Python
            else:
                target.write(save(dict(value), metadata=extra))

        if SAFETENSORS_METADATA_KEY in tensors:
            raise CheckpointError(f"cannot save {name}: its state has a tensor named {SAFETENSORS_METADATA_KEY!r}, the key "
                                  "the safetensors format reserves for a file's metadata (such a file cannot be loaded "
                                  "back); rename that parameter or buffer")
        tensors = {key: value.contiguous() for key, value in tensors.items()}
        hashed_write = None
        if hashed_safetensors.supported(tensors):
            def hashed_write(path: str, value: Mapping[str, Any]) -> Any:
                return hashed_safetensors.write_hashed(path, value, metadata=extra)
        return self._write(name, write, tensors, fault_phase, hashed_write=hashed_write)

    def library_write(self, write: Callable[[], Sequence[str]]) -> None:
        """Files a library writes itself (DCP, an engine): ``write()`` writes them and returns their
        paths, relative to the directory; the writer fsyncs, sizes and hashes them. Called now, or in
        an asynchronous save's background half — before the deferred files, in the order given, on
        every rank alike (a collective library stays matched) — so ``write`` must hold only what does
        not change with training (a CPU copy staged before the call) and run its collectives on
        :attr:`background_group`."""
        if self.deferred:
            self._library_writes.append(write)
            return
        for name in write():
            self.record(name)

    def record(self, name: str) -> FileRecord:
        """Account for a file a library wrote into the directory itself: fsync, size, hash."""
        path = os.path.join(self.directory, name)
        fsync_path(path)
        record = FileRecord(path=_normalise(name), size=os.path.getsize(path),
                            sha256=hash_file(path) if self.hashing else None, rank=self.rank)
        with self._lock:
            self._records[record.path] = record
        return record

    def _write(self, name: str, write: Callable[[Any, Any], None], value: Any, fault_phase: str | None,
               hashed_write: Callable[[str, Any], Any] | None = None) -> str:
        name = _normalise(name)
        if self.deferred:
            self._pending.append((name, write, _snapshot(value, self.staging, name), fault_phase, hashed_write))
        else:
            self._write_now(name, write, value, fault_phase, hashed_write)
        return name

    def _write_now(self, name: str, write: Callable[[Any, Any], None], value: Any, fault_phase: str | None,
                   hashed_write: Callable[[str, Any], Any] | None = None) -> None:
        path = os.path.join(self.directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not (fault_phase and faults.armed(fault_phase, self.rank)):
            # Fast path: the library writes the file itself; its fsync waits for records(), so the
            # kernel writes this file back while the next one is being written. With hashing, a
            # format that can be hashed while it is written is (hashed_write: safetensors, see
            # checkpoint.hashed_safetensors); any other file is hashed by a thread once written,
            # beside the next file's write (sha256 releases the GIL).
            hasher: Any = None
            try:
                if self.hashing and hashed_write is not None:
                    hasher = hashed_write(path, value)
                else:
                    write(path, value)
            except Exception as exc:  # OSError, torch.save's RuntimeError, safetensors' SafetensorError
                raise CheckpointError(describe_write_failure(exc, path)) from exc
            if self.hashing and hasher is None:
                hasher = PendingDigest(lambda: file_chunks(path), path)
            with self._lock:
                self._records[name] = FileRecord(path=name, size=os.path.getsize(path), rank=self.rank)
                self._unsynced.append(path)
                if hasher is not None:
                    self._hashing[name] = hasher
            return
        try:
            handle = _StreamingFile(path, self.hashing, fault_phase, self.rank)
        except OSError as exc:
            raise CheckpointError(describe_os_error(exc, path)) from exc
        try:
            write(handle, value)
            digest = handle.close()
        except OSError as exc:
            handle.abort()
            raise CheckpointError(describe_os_error(exc, path)) from exc
        except BaseException:
            handle.abort()
            raise
        with self._lock:
            self._records[name] = FileRecord(path=name, size=handle.size, sha256=digest, rank=self.rank)

    # -- finishing -------------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        return bool(self._pending or self._library_writes)

    def flush(self) -> None:
        """Write what was deferred (the background half of an asynchronous save): the library writes
        first (collective: the first to fail stops the rest, as it fails on every rank), then the files."""
        library_writes, self._library_writes = self._library_writes, []
        for write in library_writes:
            for name in write():
                self.record(name)
        pending, self._pending = self._pending, []
        for name, write, value, fault_phase, hashed_write in pending:
            self._write_now(name, write, value, fault_phase, hashed_write)

    def records(self, extra: list[str] | None = None) -> list[FileRecord]:
        """Every file this rank wrote, each fsynced by now; ``extra`` names files written
        without the writer. Called before the checkpoint is committed."""
        for name in extra or ():
            if _normalise(name) not in self._records:
                self.record(name)
        with self._lock:
            unsynced, self._unsynced = self._unsynced, []
            hashing, self._hashing = self._hashing, {}
        outcomes = _fsync_all(unsynced)
        for path, exc in zip(unsynced, outcomes):
            if exc is not None:  # a delayed write error (e.g. the disk filled up) surfaces here
                raise CheckpointError(describe_os_error(exc, path)) from exc
        digests = {}
        for name, hasher in hashing.items():
            try:
                digests[name] = hasher.result()
            except OSError as exc:  # the file could not be read back
                raise CheckpointError(describe_os_error(exc, hasher.path)) from exc
        with self._lock:
            for name, digest in digests.items():
                self._records[name] = attrs.evolve(self._records[name], sha256=digest)
            return sorted(self._records.values(), key=lambda r: r.path)


def _fsync_all(paths: list[str]) -> list[OSError | None]:
    """fsync ``paths`` concurrently (concurrent fsyncs share the filesystem's journal commits).
    Plain threads, not an executor: ``concurrent.futures`` refuses new work once the interpreter
    is shutting down, which is when the last asynchronous save of a script finishes."""
    outcomes: list[OSError | None] = [None] * len(paths)
    if len(paths) <= 1:
        return [_fsync_outcome(path) for path in paths]
    lanes = min(8, len(paths))

    def lane(start: int) -> None:
        for index in range(start, len(paths), lanes):
            outcomes[index] = _fsync_outcome(paths[index])

    threads = [threading.Thread(target=lane, args=(i,), name="torchrig-fsync", daemon=True) for i in range(lanes)]
    started = []
    try:
        for thread in threads:
            thread.start()
            started.append(thread)
    except RuntimeError:  # no new threads at this point of interpreter shutdown: the rest one by one
        for index in range(len(started), lanes):
            lane(index)
    for thread in started:
        thread.join()
    return outcomes


def _fsync_outcome(path: str) -> OSError | None:
    try:
        fsync_path(path)
    except OSError as exc:
        return exc
    return None


def _normalise(name: str) -> str:
    name = os.path.normpath(name).replace(os.sep, "/")
    if name.startswith("../") or name == ".." or os.path.isabs(name):
        raise ValueError(f"checkpoint file {name!r} must be a path inside the checkpoint directory")
    return name


__all__ = ["CheckpointError", "CheckpointWriter", "FileRecord", "describe", "describe_os_error", "fsync_path", "hash_file"]
