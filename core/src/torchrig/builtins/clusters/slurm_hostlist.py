"""Slurm's compact syntaxes, expanded: host lists (``node[01-03,07],gpu-a1``, like ``scontrol show
hostnames``) and tasks per node (``4(x2),3``). Pure string functions, apart from :mod:`.slurm` because
they are a parser of their own; torch-free, import nothing of torchrig.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence

_HOST_ITEM = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _split_top_level(hostlist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(hostlist):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in host list {hostlist!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {hostlist!r}")
        elif char == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in host list {hostlist!r}")
    items.append(hostlist[start:])
    return items


#: One bracket group: inclusive ``(low, high, width)`` ranges, expanded lazily.
_Ranges = tuple[tuple[int, int, int], ...]


def _parse_ranges(body: str, hostlist: str) -> _Ranges:
    """``"01-03,07"`` → ``((1, 3, 2), (7, 7, 2))``; zero padding follows the low bound's width."""
    out = []
    for piece in body.split(","):
        piece = piece.strip()
        match = _RANGE.fullmatch(piece)
        if not match:
            raise ValueError(f"bad range {piece!r} in host list {hostlist!r} (expected N or N-M)")
        low_text, high_text = match.group(1), match.group(2)
        low, high = int(low_text), int(high_text if high_text is not None else low_text)
        if high < low:
            raise ValueError(f"descending range {piece!r} in host list {hostlist!r}")
        out.append((low, high, len(low_text)))
    return tuple(out)


def _parse_hostlist(hostlist: str) -> list[list[str | _Ranges]]:
    """Each top-level item as its segments: literal text, or a bracket group's ranges."""
    if not hostlist or not hostlist.strip():
        raise ValueError("empty host list")
    parsed = []
    for item in _split_top_level(hostlist.strip()):
        item = item.strip()
        if not item:
            raise ValueError(f"empty host name in host list {hostlist!r}")
        segments: list[str | _Ranges] = []
        position = 0
        for match in _HOST_ITEM.finditer(item):
            segments.append(item[position:match.start()])
            segments.append(_parse_ranges(match.group(1), hostlist))
            position = match.end()
        segments.append(item[position:])
        if any(isinstance(seg, str) and ("[" in seg or "]" in seg) for seg in segments):
            raise ValueError(f"unbalanced brackets in host list {hostlist!r}")
        parsed.append(segments)
    return parsed


def _iter_segment(segment: str | _Ranges) -> Iterator[str]:
    if isinstance(segment, str):
        yield segment
        return
    for low, high, width in segment:
        for number in range(low, high + 1):
            yield f"{number:0{width}d}"


def _iter_product(segments: Sequence[str | _Ranges]) -> Iterator[str]:
    """Left-most group outermost, like ``scontrol show hostnames``; nothing is materialised."""
    if not segments:
        yield ""
        return
    for head in _iter_segment(segments[0]):
        for tail in _iter_product(segments[1:]):
            yield head + tail


def iter_hostlist(hostlist: str) -> Iterator[str]:
    """Expand a Slurm host list lazily (the whole string is validated first), so taking the
    first host of ``n[0000000-9999999]`` costs nothing."""
    parsed = _parse_hostlist(hostlist)
    for segments in parsed:
        yield from _iter_product(segments)


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm compressed host list, like ``scontrol show hostnames``.

    ``"node[01-03,07],gpu-a1"`` → ``node01 node02 node03 node07 gpu-a1``. Commas separate hosts at
    the top level and ranges inside brackets; a range keeps the zero padding of its low bound
    (``[08-10]`` → ``08 09 10``); several bracket groups in one name expand left to right
    (``r[1-2]n[1-2]`` → ``r1n1 r1n2 r2n1 r2n2``). Malformed lists raise ``ValueError``.
    """
    return list(iter_hostlist(hostlist))


def parse_tasks_per_node(value: str) -> list[int]:
    """Expand Slurm's ``SLURM_TASKS_PER_NODE`` syntax: ``"4(x2),3"`` → ``[4, 4, 3]``."""
    out: list[int] = []
    for piece in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", piece)
        if not match:
            raise ValueError(f"bad tasks-per-node entry {piece!r} in {value!r} (expected N or N(xR))")
        count, repeats = int(match.group(1)), int(match.group(2) or 1)
        if repeats < 1:
            raise ValueError(f"bad repeat count in {piece!r} of {value!r}")
        out.extend([count] * repeats)
    return out


__all__ = ["expand_hostlist", "iter_hostlist", "parse_tasks_per_node"]
