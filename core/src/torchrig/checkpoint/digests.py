"""sha256 digests of checkpoint files computed beside the writing: shared by the checkpoint writer
(:mod:`torchrig.checkpoint.files`) and the safetensors writer that hashes while it writes
(:mod:`torchrig.checkpoint.hashed_safetensors`). Standard library only."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

#: Bytes read at a time when a file is hashed from disk.
READ_CHUNK = 16 * 1024 * 1024


def file_chunks(path: str) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        while chunk := handle.read(READ_CHUNK):
            yield chunk


class PendingDigest:
    """The sha256 of some bytes (a file just written, or the tensors being written), computed by
    a thread of its own so that hashing runs beside the next write (sha256 releases the GIL);
    :meth:`result` waits for it. Inline when the interpreter is shutting down and refuses new
    threads (the last async save of a script)."""

    def __init__(self, chunks: Callable[[], Iterable[Any]], path: str) -> None:
        self.path = path
        self._chunks: Callable[[], Iterable[Any]] | None = chunks
        self._digest: str | None = None
        self._failure: BaseException | None = None
        self._thread: threading.Thread | None = threading.Thread(target=self._run, name="torchrig-hash", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:
            self._thread = None
            self._run()

    def _run(self) -> None:
        chunks, digest = self._chunks, hashlib.sha256()
        assert chunks is not None
        try:
            for chunk in chunks():
                digest.update(chunk)
            self._digest = digest.hexdigest()
        except BaseException as exc:  # reported to whoever asks for the result
            self._failure = exc
        finally:
            self._chunks = None  # the bytes need not stay alive any longer

    def result(self) -> str:
        if self._thread is not None:
            self._thread.join()
        if self._failure is not None:
            raise self._failure
        assert self._digest is not None
        return self._digest


__all__ = ["READ_CHUNK", "PendingDigest", "file_chunks"]
