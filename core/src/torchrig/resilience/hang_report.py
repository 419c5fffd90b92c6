"""The launcher's comparison of the ranks' hang dumps: which ranks are in which collective.

Each rank that timed out in a collective, lost a peer in one, or was stopped by the launcher, wrote
``rank-N.hang.json`` (:mod:`torchrig.resilience.collective_trace`). Ranks that agree (same
collective, sequence number, group, shapes and call site) are put together; where they do not,
the report says so, e.g. "rank 3 is in all_reduce #2 of group default_pg (ranks 0–3), called at
train.py:14; ranks 0–2 are in all_gather #2 of group default_pg (ranks 0–3), called at
train.py:16: mismatched collectives". Pure functions over plain dicts and files, torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from typing import Any

from torchrig.resilience.collective_trace import TIMEOUT, dump_path


def load_dumps(log_dir: str, ranks: Iterable[int], attempt: int | None = None) -> dict[int, dict[str, Any]]:
    """The hang dumps of ``ranks`` in ``log_dir`` (of ``attempt`` where given); unreadable ones skipped."""
    dumps = {}
    for rank in ranks:
        try:
            with open(dump_path(log_dir, rank)) as handle:
                data = json.load(handle)
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and (attempt is None or data.get("attempt") in (None, attempt)):
            dumps[rank] = data
    return dumps


def forget_dumps(log_dir: str, ranks: Iterable[int]) -> None:
    """Remove the previous attempt's dumps, so they are not read as this one's."""
    for rank in ranks:
        try:
            os.unlink(dump_path(log_dir, rank))
        except OSError:
            pass


def format_ranks(ranks: Iterable[int]) -> str:
    """``rank 3`` / ``ranks 0–2, 4–7``: consecutive ranks as ranges."""
    ordered = sorted(set(ranks))
    spans: list[str] = []
    start = previous = None
    for rank in [*ordered, None]:
        if start is not None and (rank is None or rank != previous + 1):
            spans.append(str(start) if start == previous else f"{start}\u2013{previous}")
            start = None
        if rank is not None and start is None:
            start = rank
        previous = rank
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(spans)


def _group(collective: Mapping[str, Any]) -> str:
    desc, name = collective.get("group_desc") or "", collective.get("group") or "?"
    label = desc if desc and desc != "undefined" else name
    members = collective.get("group_ranks") or []
    return f"group {label}" + (f" ({format_ranks(members)})" if members else "")


def _shapes(collective: Mapping[str, Any]) -> str:
    sizes, dtypes = collective.get("input_sizes") or [], collective.get("input_dtypes") or []
    return ", ".join(f"{dtype}{list(size)}" for size, dtype in zip(sizes, dtypes))


def _where(dump: Mapping[str, Any]) -> dict[str, Any]:
    """What one rank was doing: its oldest unfinished collective, or None, and where."""
    collectives = dump.get("collectives") or []
    collective = collectives[0] if collectives else None
    site = (collective or {}).get("call_site") or dump.get("call_site")
    return {"collective": collective, "call_site": site}


def _key(where: Mapping[str, Any]) -> tuple[Any, ...]:
    collective = where["collective"]
    if collective is None:
        return ("none", where["call_site"])
    return (collective["op"], collective.get("seq"), collective.get("group"), json.dumps(collective.get("input_sizes")),
            json.dumps(collective.get("input_dtypes")), where["call_site"])


def _describe(ranks: list[int], where: Mapping[str, Any]) -> str:
    verb = "is" if len(ranks) == 1 else "are"
    site = f", called at {where['call_site']}" if where["call_site"] else ""
    collective = where["collective"]
    if collective is None:
        at = f", at {where['call_site']}" if where["call_site"] else ""
        return f"{format_ranks(ranks)} {verb} in no collective{at}"
    shapes = _shapes(collective)
    return (f"{format_ranks(ranks)} {verb} in {collective['op']} #{collective.get('seq')} of {_group(collective)}"
            + (f" [{shapes}]" if shapes else "") + site)


def diagnose(dumps: Mapping[int, Mapping[str, Any]], world_ranks: Iterable[int] = ()) -> dict[str, Any] | None:
    """Compare the ranks' dumps: None unless a rank's collective timed out. ``verdict``: ``mismatched`` (ranks in different collectives of one sequence number),
    ``out of step`` (different sequence numbers), ``not in a collective`` (a rank the others wait
    for), ``same collective`` (every reporting rank in the same one)."""
    places = {rank: _where(dump) for rank, dump in sorted(dumps.items())}
    if not any(dump.get("reason") == TIMEOUT for dump in dumps.values()):
        return None  # stopped ranks alone: a failure elsewhere, not a hang
    by_key: dict[tuple[Any, ...], list[int]] = {}
    for rank, where in places.items():
        by_key.setdefault(_key(where), []).append(rank)
    # ranks outside any collective first, then the smallest set: the odd one out is usually the culprit
    kinds = sorted(by_key.values(), key=lambda ranks: (places[ranks[0]]["collective"] is not None, len(ranks), ranks[0]))
    parts = [_describe(ranks, places[ranks[0]]) for ranks in kinds]
    collectives = [places[ranks[0]]["collective"] for ranks in kinds]
    if len(kinds) == 1:
        verdict = "same collective"
        text = parts[0] + ": the same collective on every rank that reported, and it did not complete"
    elif any(c is None for c in collectives):
        verdict = "not in a collective"
        text = "; ".join(parts) + ": the ranks outside any collective never reached the others'"
    elif len({c.get("seq") for c in collectives}) == 1:
        verdict = "mismatched"
        text = "; ".join(parts) + ": mismatched collectives"
    else:
        verdict = "out of step"
        text = "; ".join(parts) + ": the ranks are at different collectives (one called a collective the others did not)"
    if verdict in ("mismatched", "out of step"):
        sites = [places[ranks[0]]["call_site"] for ranks in kinds if places[ranks[0]]["call_site"]]
        sites = list(dict.fromkeys(sites))
        if len(sites) > 1:
            text += ", called at " + " vs ".join(sites)
    silent = sorted(set(world_ranks) - set(dumps))
    if silent:
        text += f"; {format_ranks(silent)} wrote no hang dump (exited or killed before it could)"
    return {"verdict": verdict, "text": text,
            "ranks": {str(rank): {"collective": where["collective"], "call_site": where["call_site"],
                                  "reason": dumps[rank].get("reason")} for rank, where in places.items()}}


__all__ = ["diagnose", "forget_dumps", "format_ranks", "load_dumps"]
