"""A rank's hang dump: which collective it is in and where its Python code was.

Why: when a collective times out (or the launcher tears a stuck rank down), "rank 0 timed out"
says nothing about *which* collective the ranks disagree on. torch's own Flight Recorder keeps a
ring buffer of every collective each process group issued — gloo included in torch 2.13 — with
its name, per-group sequence number, shapes, dtypes, whether it completed, and the Python frames
that called it. Nothing is added to the hot path here: torch records them anyway
(``TORCH_FR_BUFFER_SIZE``, set by :func:`record_collectives` where the user did not choose), and
this module only reads the buffer once, when the rank is failing or being stopped.

The dump is ``<log_dir>/rank-N.hang.json``; :mod:`torchrig.resilience.hang_report` compares the
ranks' dumps in the launcher. Torch is looked up in ``sys.modules``, never imported: a rank that
never used torch.distributed has nothing to dump, and the launcher's worker wrapper imports this
module before the user's script.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
import sysconfig
import tempfile
import threading
import traceback
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

#: Collectives torch's Flight Recorder keeps per process (a ring buffer; torch's default where unset).
RECORDED_COLLECTIVES = 2000
#: The environment variables that size the Flight Recorder (torch reads the first, NCCL builds the second).
FR_BUFFER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
#: torchrig's package and its plugins' (``torchrig_fsdp``...): frames there are not the user's.
_TORCHRIG_PACKAGE = re.compile(r"torchrig(_\w+)?")
_DUMP_NAME = "rank-{rank}.hang.json"
#: Words of a collective timeout in gloo, NCCL and torch.distributed messages.
TIMEOUT_WORDS = re.compile(r"timed?[ -]?out|timeout|deadline exceeded", re.IGNORECASE)
#: Errors a rank gets because *another* rank went away (gloo's "Connection closed by peer", NCCL's
#: aborted communicator): inside a collective, the rank was as stuck as one that timed out.
PEER_LOST_WORDS = re.compile(
    r"closed by peer|reset by peer|connection reset|connection closed|broken pipe|remote worker|"
    r"communicator was aborted|socket closed|peer .*(?:closed|gone|died)|Connection refused", re.IGNORECASE)
#: ``reason`` of a dump: the rank's own collective timed out / a peer went away while the rank was in a
#: collective (under load a slower rank's timeout is often preceded by a faster one's exit) / the launcher
#: stopped the rank.
TIMEOUT, PEER_LOST, STOPPED = "timeout", "peer lost", "stopped"


def dump_path(log_dir: str, rank: int) -> str:
    """Where rank ``rank`` writes its hang dump."""
    return os.path.join(log_dir, _DUMP_NAME.format(rank=rank))


def record_collectives(environ: MutableMapping[str, str] | None = None) -> None:
    """Ask torch's Flight Recorder to keep the last :data:`RECORDED_COLLECTIVES` collectives,
    unless the user sized it (before torch creates a process group: the wrapper calls it first)."""
    environ = os.environ if environ is None else environ
    if not any(name in environ for name in FR_BUFFER_VARIABLES):
        environ[FR_BUFFER_VARIABLES[0]] = str(RECORDED_COLLECTIVES)


def is_user_file(filename: str) -> bool:
    """Whether a frame's file is the user's: not torch's or another installed package's, not the
    standard library's, not torchrig's or its plugins' (packages named ``torchrig``/``torchrig_*``)."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.abspath(filename)
    libraries = tuple(os.path.abspath(p) + os.sep for p in {sysconfig.get_path(name)
                                                            for name in ("stdlib", "purelib", "platlib")} if p)
    if path.startswith(libraries):
        return False
    directory = os.path.dirname(path)
    while directory != os.path.dirname(directory):
        if _TORCHRIG_PACKAGE.fullmatch(os.path.basename(directory)) and os.path.exists(
                os.path.join(directory, "__init__.py")):
            return False
        directory = os.path.dirname(directory)
    return True


def is_timeout_error(exc: BaseException) -> bool:
    """Whether an exception says a collective (or the store behind it) timed out."""
    return bool(TIMEOUT_WORDS.search(f"{type(exc).__name__}: {exc}"))


def is_peer_lost_error(exc: BaseException) -> bool:
    """Whether an exception says a peer of this rank's collective went away."""
    return bool(PEER_LOST_WORDS.search(f"{type(exc).__name__}: {exc}"))


def user_call_site(frames: Iterable[tuple[str, int, str]]) -> str | None:
    """``file:line`` of the innermost user frame of ``frames`` (outermost first), or None."""
    users = [(filename, line) for filename, line, _ in frames if is_user_file(filename)]
    return f"{users[-1][0]}:{users[-1][1]}" if users else None


def flight_recorder_entries() -> list[dict[str, Any]]:
    """Every collective torch's Flight Recorder holds for this process (NCCL's and the generic
    one's, oldest first); empty where torch.distributed was never used or records nothing."""
    c10d = _c10d()
    if c10d is None:
        return []
    entries: dict[tuple[Any, ...], dict[str, Any]] = {}
    for dump_name in ("_dump_nccl_trace", "_dump_fr_trace"):
        dump = getattr(c10d, dump_name, None)
        if dump is None:
            continue
        try:
            data = pickle.loads(dump(True, True, False))  # collectives, with stack traces, all of them
        except Exception:  # noqa: BLE001 -- a recorder that cannot dump is no diagnosis, not a second failure
            continue
        for entry in data.get("entries") or []:
            key = (tuple(entry.get("process_group") or ()), entry.get("record_id"), entry.get("profiling_name"))
            entries.setdefault(key, entry)
    return sorted(entries.values(), key=lambda e: (e.get("time_created_ns") or 0, e.get("record_id") or 0))


def group_ranks() -> dict[str, list[int]]:
    """Global ranks of every process group of this process, by the group's name (the Flight
    Recorder names groups, not their members, for gloo)."""
    torch_c10d = sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(torch_c10d, "_world", None)
    try:
        names, members = world.pg_names, world.pg_group_ranks  # type: ignore[union-attr]
        return {str(names[group]): sorted(int(r) for r in ranks) for group, ranks in members.items() if group in names}
    except Exception:  # noqa: BLE001 -- private bookkeeping that moved: the dump goes without members
        return {}


def in_flight(entries: list[dict[str, Any]], ranks_by_group: Mapping[str, list[int]]) -> list[dict[str, Any]]:
    """The collectives that were issued and never completed, oldest first, described plainly."""
    return [describe(entry, ranks_by_group) for entry in entries
            if not entry.get("retired") and entry.get("state") != "completed"]


def describe(entry: Mapping[str, Any], ranks_by_group: Mapping[str, list[int]]) -> dict[str, Any]:
    """One Flight Recorder entry as the hang report reads it."""
    name, description = (list(entry.get("process_group") or ()) + ["", ""])[:2]
    frames = [(f.get("filename", ""), int(f.get("line") or 0), f.get("name", "")) for f in entry.get("frames") or []]
    frames.reverse()  # the recorder lists the innermost frame first
    return {
        "op": str(entry.get("profiling_name") or "?").rpartition(":")[2],
        "seq": entry.get("collective_seq_id") if not entry.get("is_p2p") else entry.get("p2p_seq_id"),
        "p2p": bool(entry.get("is_p2p")),
        "group": str(name), "group_desc": str(description),
        "group_ranks": list(ranks_by_group.get(str(name), [])),
        "input_sizes": [list(s) for s in entry.get("input_sizes") or []],
        "input_dtypes": list(entry.get("input_dtypes") or []),
        "state": entry.get("state"), "timeout_ms": entry.get("timeout_ms"),
        "call_site": user_call_site(frames),
        "frames": [f"{f}:{line} in {fn}" for f, line, fn in frames],
    }


def write_dump(log_dir: str, rank: int, *, reason: str, stack: list[tuple[str, int, str]],
               attempt: int | None = None) -> str | None:
    """Write this rank's hang dump (``stack``: the main thread's frames, outermost first, where the
    rank was). Nothing where torch.distributed was never initialised. Returns the path written."""
    if not _process_group_initialized():
        return None
    try:
        return _write_dump(log_dir, rank, reason=reason, stack=stack, attempt=attempt)
    except Exception as exc:  # noqa: BLE001 -- a diagnosis must never change how the rank ends
        print(f"torchrig: no hang dump for rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def _write_dump(log_dir: str, rank: int, *, reason: str, stack: list[tuple[str, int, str]],
                attempt: int | None) -> str | None:
    ranks_by_group = group_ranks()
    entries = flight_recorder_entries()
    collectives = in_flight(entries, ranks_by_group)
    if not collectives and reason in (TIMEOUT, PEER_LOST) and entries:
        # gloo retires the work that raised: the newest collective is the one that timed out or lost its peer
        collectives = [describe(entries[-1], ranks_by_group)]
    data = {
        "rank": rank, "attempt": attempt, "pid": os.getpid(), "reason": reason,
        "collectives": collectives,
        "call_site": user_call_site(stack),
        "stack": [f"{f}:{line} in {fn}" for f, line, fn in stack],
        "threads": _all_thread_stacks(),
    }
    path = dump_path(log_dir, rank)
    handle, temporary = tempfile.mkstemp(dir=log_dir, prefix=".hang-", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as out:
            json.dump(data, out, indent=1, default=str)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):  # not published: a full disk, say
            os.unlink(temporary)
    return path


def frames_of(stack: Any) -> list[tuple[str, int, str]]:
    """``(file, line, function)`` outermost first, from a traceback or a frame."""
    summary = traceback.extract_tb(stack) if hasattr(stack, "tb_frame") else traceback.extract_stack(stack)
    return [(f.filename, f.lineno or 0, f.name) for f in summary]


def _all_thread_stacks() -> dict[str, str]:
    """Every thread's Python stack (``faulthandler``'s view, readable), by thread name."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return {f"{names.get(ident, 'thread')} ({ident})": "".join(traceback.format_stack(frame))
            for ident, frame in sys._current_frames().items()}


def _c10d() -> Any:
    torch_c = getattr(sys.modules.get("torch"), "_C", None)
    return getattr(torch_c, "_distributed_c10d", None)


def _process_group_initialized() -> bool:
    distributed = sys.modules.get("torch.distributed")
    try:
        return bool(distributed is not None and distributed.is_available() and distributed.is_initialized())
    except Exception:  # noqa: BLE001 -- a torch too broken to answer has no process group to report
        return False


__all__ = ["FR_BUFFER_VARIABLES", "RECORDED_COLLECTIVES", "STOPPED", "TIMEOUT", "describe", "dump_path", "flight_recorder_entries", "frames_of",
           "group_ranks", "in_flight", "is_peer_lost_error", "is_timeout_error", "is_user_file", "record_collectives", "user_call_site", "write_dump"]
