"""A loaded config file: its plain data and where each value came from (torch-free, yaml-free).

Separate from :mod:`torchrig.config.loader` so that resolving a configuration that reads no
file (the common ``python train.py``) never imports pyyaml (~10 ms of regex compilation).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

__all__ = ["Document", "Mark", "Path"]

#: A path into a document's data: mapping keys and list indices.
Path = tuple[str | int, ...]


@attrs.frozen
class Mark:
    """A position in a config file, 1-based, printed ``file:line:column`` like compilers do."""

    file: str
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@attrs.frozen
class Document:
    """One loaded config file: plain ``data`` plus where each value came from.

    ``marks`` maps a path (tuple of keys and list indices) to the mark of the entry: the key's
    mark for mapping entries, the item's for list items; ``()`` is where the document starts.
    ``raw_scalars`` maps a path to the source text of a *plain* (unquoted) YAML scalar that was
    resolved to bool/null/int/float, e.g. ``("mixed_precision",) -> "no"``.
    """

    data: dict[str, Any]
    file: str
    marks: Mapping[Path, Mark] = attrs.field(factory=dict)
    raw_scalars: Mapping[Path, str] = attrs.field(factory=dict)

    def mark(self, path: Iterable[str | int]) -> Mark | None:
        """The mark of ``path``, else of its closest ancestor that has one (None if none has)."""
        path = tuple(path)
        for end in range(len(path), -1, -1):
            found = self.marks.get(path[:end])
            if found is not None:
                return found
        return None

    def where(self, path: Iterable[str | int] = ()) -> str:
        """``file:line:column`` for ``path`` (or its nearest ancestor), else just the file."""
        found = self.mark(path)
        return str(found) if found is not None else self.file
