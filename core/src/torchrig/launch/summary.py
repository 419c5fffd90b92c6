"""Naming what went wrong: the failure summary and ``run_status.json``.

Why not torch elastic's own report: it picks the "root cause" by a whole-second timestamp and
blames the wrong rank when the culprit left through ``sys.exit`` or hung (measured). Here each
rank's record carries the time it stopped (its wrapper writes the moment it caught the
exception; the launcher sees a killed process exit through ``waitid``), so:

* the culprit is the rank that **failed first**; ranks that failed afterwards are listed as
  "also failed" with their own first line, ranks the launcher stopped as "torn down". A rank
  whose error says it lost a peer ("Connection closed by peer") ranks after every rank that
  failed on its own: a killed rank's exit is seen a few milliseconds late, its peers' errors
  may be stamped earlier, and the death caused them;
* when the first failure is a collective **timeout**, the rank that was still running outside
  any collective when the job was torn down is the **stalled** one, and is named instead;
* when every failure is a lost peer or a timeout and a rank had **exited with code 0 before**
  them, that rank **left early** (returned while the others still waited for it in a
  collective) and is named: its exit, not the errors of the ranks left waiting, is the cause.

Pure functions over plain dicts (the records of :mod:`torchrig.launch.elastic`), torch-free.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torchrig.launch.status import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    PREEMPTED,
    RUN_STATUS_FILE,
    RUNNING,
    TERMINATED,
    read_json,
    write_json_atomic,
)
from torchrig.resilience.collective_trace import PEER_LOST_WORDS, TIMEOUT_WORDS

#: A rank stopped inside one of these was waiting for the others, not stalled.
_COLLECTIVE_FRAMES = ("torch/distributed/", "torch\\distributed\\")
NEVER_STARTED = "never started"


def _when(record: Mapping[str, Any]) -> float:
    value = record.get("ended_at")
    return float(value) if isinstance(value, (int, float)) else float("inf")


def is_timeout(record: Mapping[str, Any]) -> bool:
    text = f"{record.get('error') or ''}\n{_last_lines(record.get('traceback'), 3)}"
    return bool(TIMEOUT_WORDS.search(text))


def lost_peer(record: Mapping[str, Any]) -> bool:
    """Whether the rank failed because a peer went away (its error says so)."""
    text = f"{record.get('error') or ''}\n{_last_lines(record.get('traceback'), 3)}"
    # a peer's loss is never the culprit while a rank that failed on its own exists (a killed rank's exit
    # is seen a few ms late, its peers' errors early)
    return bool(PEER_LOST_WORDS.search(text))


def in_collective(record: Mapping[str, Any]) -> bool:
    """Whether the rank was inside torch.distributed when it was stopped."""
    return any(marker in (record.get("traceback") or "") for marker in _COLLECTIVE_FRAMES)


def _last_lines(text: str | None, n: int) -> str:
    return "\n".join((text or "").splitlines()[-n:])


def analyze(records: Sequence[Mapping[str, Any]], *, launcher_signal: str | None = None,
            launch_error: str | None = None) -> dict[str, Any]:
    """The verdict on one attempt: state, culprit and why, and each rank's role."""
    # First by time, except that a rank that lost its peer comes after every rank that failed on
    # its own: the peer's death caused its error, whatever the clocks say.
    failed = sorted((r for r in records if r.get("state") == FAILED), key=lambda r: (lost_peer(r), _when(r), r["rank"]))
    stopped = [r for r in records if r.get("state") in (TERMINATED, INTERRUPTED, RUNNING)]
    verdict: dict[str, Any] = {
        "state": FINISHED, "culprit": None, "reason": None, "failing_ranks": [r["rank"] for r in failed],
        "stalled_ranks": [], "torn_down_ranks": sorted(r["rank"] for r in stopped), "headline": "",
    }
    if failed:
        first = failed[0]
        verdict.update(state=FAILED, culprit=first["rank"], reason="failed first",
                       headline=f"rank {first['rank']} failed first ({_cause(first)})")
        stalled = sorted(r["rank"] for r in stopped if not in_collective(r)) if is_timeout(first) else []
        left = _left_early(records, first) if not stalled and (lost_peer(first) or is_timeout(first)) else None
        if left is not None:
            verdict.update(culprit=left["rank"], reason="left early", headline=(
                f"rank {left['rank']} exited (code 0) while the other ranks still needed it: rank {first['rank']} "
                f"then failed waiting for it ({_cause(first, limit=200)})"))
        if stalled:
            names = _ranks(stalled)
            verb = "was" if len(stalled) == 1 else "were"
            verdict.update(culprit=stalled[0], reason="stalled", stalled_ranks=stalled,
                           headline=(f"{names} stalled: rank {first['rank']} timed out in a collective that "
                                     f"{names} never reached ({names} {verb} still running elsewhere)"))
    elif records and all(r.get("state") == PREEMPTED for r in records):
        first = min(records, key=lambda r: r["rank"])
        stop = first.get("preempted") or {}
        where = f"checkpoint {stop['checkpoint']} committed after optimizer step {stop.get('step')}" \
            if stop.get("checkpoint") else "every rank stopped after the preemption checkpoint"
        then = f"; the job was requeued ({stop['requeued']})" if stop.get("requeued") else "; run it again to resume"
        verdict.update(state=PREEMPTED, reason="preempted",
                       headline=f"preempted by {stop.get('signal') or 'a signal'}: {where}{then}")
    elif launcher_signal:
        state = INTERRUPTED if launcher_signal == "SIGINT" else TERMINATED
        verdict.update(state=state, headline=f"stopped by {launcher_signal}: every rank was told to stop")
        waiting = [r for r in stopped if r.get("waiting")]
        if waiting:
            verdict["headline"] += f"; {_ranks([r['rank'] for r in waiting])} waited on something: {waiting[0]['waiting']}"

    elif launch_error:
        verdict.update(state=FAILED, reason="launch error", headline=launch_error)
    elif any(r.get("state") != FINISHED for r in records) or not records:
        verdict.update(state=FAILED, reason="unknown", headline="the workers did not all finish")
    if launcher_signal and failed:
        verdict["headline"] += f"; then the launcher got {launcher_signal}"
    if launch_error and (failed or launcher_signal):
        verdict["headline"] += f"; {launch_error}"
    return verdict


def _left_early(records: Sequence[Mapping[str, Any]], first_failed: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The first rank that finished (exit code 0) before ``first_failed`` failed, if any."""
    finished = [r for r in records if r.get("state") == FINISHED and _when(r) <= _when(first_failed)]
    return min(finished, key=lambda r: (_when(r), r["rank"]), default=None)


def _ranks(ranks: Iterable[int]) -> str:
    ranks = list(ranks)
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _cause(record: Mapping[str, Any], limit: int = 400) -> str:
    bits = []
    if record.get("exit_code") is not None:
        bits.append(f"exit code {record['exit_code']}")
    if record.get("error"):
        error = str(record["error"])
        bits.append(error if len(error) <= limit else error[: limit - 3] + "...")
    return ": ".join(bits) if bits else "no details"


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def format_summary(verdict: Mapping[str, Any], records: Sequence[Mapping[str, Any]], *, log_dir: str | None = None,
                   restarts_used: int = 0, max_restarts: int = 0, warnings: Sequence[str] = (),
                   tail_lines: int = 20) -> str:
    """What a person reads after a failed run: who, why (the traceback tail), the others."""
    if verdict["state"] == FINISHED:
        extra = f" after {restarts_used} restart(s)" if restarts_used else ""
        lines = [f"torchrig launch: all {len(records)} local rank(s) finished{extra}"]
        lines += [f"  warning: {w}" for w in warnings]
        return "\n".join(lines)
    lines = [f"torchrig launch: {verdict['state'].upper()}: {verdict['headline']}"]
    by_rank = {r["rank"]: r for r in records}
    first_failed = next((by_rank[r] for r in verdict["failing_ranks"] if r in by_rank), None)
    culprit = [verdict["culprit"]] if verdict.get("culprit") in by_rank else []
    order = list(dict.fromkeys([*culprit, *verdict["stalled_ranks"], *verdict["failing_ranks"], *sorted(by_rank)]))
    for rank in order:
        record = by_rank[rank]
        lines.append("  " + describe_rank(record, verdict, first_failed))
        detail = record.get("traceback") or record.get("stderr_tail")
        main_actor = rank == verdict.get("culprit") or (first_failed is not None and rank == first_failed["rank"])
        if detail and main_actor:
            lines.append(_indent(_last_lines(detail, tail_lines)))
    if max_restarts:
        lines.append(f"  restarts used: {restarts_used} of {max_restarts}")
    lines += [f"  warning: {w}" for w in warnings]
    if log_dir:
        lines.append(f"  status of every rank: {log_dir}/run_status.json (per-rank logs in {log_dir})")
    return "\n".join(lines)


def describe_rank(record: Mapping[str, Any], verdict: Mapping[str, Any], first_failed: Mapping[str, Any] | None) -> str:
    """One line per rank: its role in the failure."""
    rank, state = record["rank"], record.get("state")
    head = f"rank {rank}:"
    if rank in verdict.get("stalled_ranks", ()):
        where = _where(record)
        waiting = f"; it was waiting: {record['waiting']}" if record.get("waiting") else ""
        return f"{head} STALLED (still running when rank {verdict['failing_ranks'][0]} timed out){where}{waiting}"
    if verdict.get("reason") == "left early":
        culprit = verdict["culprit"]
        if rank == culprit:
            return f"{head} left early: exited with code 0 while the other ranks still waited for it"
        if state == FAILED:
            why = " after losing a peer" if lost_peer(record) else ""
            return f"{head} also failed{why}, waiting for rank {culprit} ({_cause(record, limit=200)})"
    if state == FAILED:
        if first_failed is not None and rank == first_failed["rank"]:
            return f"{head} failed first ({_cause(record)})"
        timing = ""
        if first_failed is not None and _when(record) < float("inf") and _when(first_failed) < float("inf"):
            delta = _when(record) - _when(first_failed)
            timing = (f" {delta:.3f} s later" if delta >= 0
                      else f" {-delta:.3f} s before rank {first_failed['rank']}'s exit was seen")
        why = ", after losing a peer" if lost_peer(record) else ""
        return f"{head} also failed{timing}{why} ({_cause(record, limit=200)})"
    if state in (TERMINATED, INTERRUPTED, RUNNING):
        how = record.get("signal") or "stopped"
        waiting = f"; it was waiting: {record['waiting']}" if record.get("waiting") else ""
        return f"{head} torn down by the launcher ({how}){_where(record) if in_collective(record) else ''}{waiting}"
    if state == FINISHED:
        return f"{head} finished"
    if state == PREEMPTED:
        return f"{head} preempted (exit code {record.get('exit_code')})"
    return f"{head} {state or NEVER_STARTED}"


def _where(record: Mapping[str, Any]) -> str:
    """``; it was at file:line`` from the innermost frame of its stop traceback."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)', record.get("traceback") or "")
    frames = [f for f in frames if "torchrig/launch/" not in f[0]]
    if not frames:
        return ""
    user = [f for f in frames if "site-packages" not in f[0] and "/lib/python" not in f[0]] or frames
    path, line, func = user[-1]
    return f"; it was at {path}:{line} in {func}"


def run_status(*, run_id: str, state: str, exit_code: int, attempts: Sequence[Mapping[str, Any]],
               plan: Mapping[str, Any], warnings: Sequence[str] = (), started_at: float | None = None) -> dict[str, Any]:
    """The merged ``run_status.json``: the last attempt's verdict and ranks, every attempt kept."""
    last = attempts[-1] if attempts else {"verdict": {}, "ranks": []}
    verdict = last.get("verdict", {})
    return {
        "run_id": run_id,
        "state": state,
        "exit_code": exit_code,
        "culprit": verdict.get("culprit"),
        "reason": verdict.get("reason"),
        "headline": verdict.get("headline"),
        "failing_ranks": verdict.get("failing_ranks", []),
        "stalled_ranks": verdict.get("stalled_ranks", []),
        "torn_down_ranks": verdict.get("torn_down_ranks", []),
        "exit_codes": {str(r["rank"]): r.get("exit_code") for r in last.get("ranks", [])},
        "restarts_used": max(0, len(attempts) - 1),
        "max_restarts": plan.get("max_restarts", 0),
        "warnings": list(warnings) + [w for r in last.get("ranks", []) for w in (r.get("warnings") or [])],
        "started_at": started_at,
        "ended_at": time.time(),
        "plan": dict(plan),
        "ranks": list(last.get("ranks", [])),
        "attempts": list(attempts),
    }


def summarize_from_files(plan: Any, exit_code: int) -> dict[str, Any]:
    """``run_status.json`` from the ranks' status files alone: for a ``torchrig_launch``
    implementation other than the core's (it ran our wrapper but wrote no run status)."""
    import glob
    import os
    import sys

    records = []
    for path in sorted(glob.glob(os.path.join(plan.log_dir, "rank-*.status.json"))):
        data = read_json(path)
        if data is not None and isinstance(data.get("rank"), int):
            records.append(data)
    records.sort(key=lambda r: r["rank"])
    verdict = analyze(records)
    if exit_code and verdict["state"] == FINISHED:
        verdict.update(state=FAILED, reason="unknown", headline=f"the launcher exited with code {exit_code}")
    attempt = {"attempt": max((r.get("attempt") or 0 for r in records), default=0), "verdict": verdict, "ranks": records}
    report = run_status(run_id=os.path.basename(os.path.normpath(plan.log_dir)), state=verdict["state"],
                        exit_code=exit_code, attempts=[attempt], plan={"max_restarts": plan.max_restarts},
                        warnings=list(plan.warnings))
    report["restarts_used"] = attempt["attempt"]
    write_json_atomic(os.path.join(plan.log_dir, RUN_STATUS_FILE), report)
    if verdict["state"] != FINISHED:
        print(format_summary(verdict, records, log_dir=plan.log_dir), file=sys.stderr, flush=True)
    return report


__all__ = ["analyze", "describe_rank", "format_summary", "in_collective", "is_timeout", "run_status", "summarize_from_files"]
