"""What one training step of one rank costs, as data: the records ``torchrig plan`` collects from a
step run under torch's fake process group and ``FakeTensorMode`` (:mod:`torchrig.estimate.recorder`),
and that the roofline (:mod:`torchrig.estimate.step_time`) turns into time on a GPU kind.

Torch-free: the same records come from a real run (the calibration tests record a real 4-rank gloo
step with the same recorder and compare), and the arithmetic on them never needs torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

#: Collective kinds, as the records name them (c10d's and the functional collectives' ops map onto these).
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce", "gather",
                    "scatter", "send", "recv", "barrier")


@attrs.frozen
class CollectiveRecord:
    """One collective this rank issued.

    ``axis``: the mesh axis (or flattened axes, ``"dp_shard_cp"``) whose process group it ran on,
    ``"world"`` for the default group, ``"group:<name>"`` for a group of no mesh axis.
    ``payload_bytes``: the collective's logical size — the all-gather's output, the
    reduce-scatter's input, the all-reduce's tensor, the all-to-all's input, a send's tensor.
    ``wire_bytes``: what this rank sends under the ring/pairwise algorithm NCCL uses at scale
    (all-gather and reduce-scatter ``(n-1)/n·S``, all-reduce ``2(n-1)/n·S``, all-to-all ``(n-1)/n·S``,
    broadcast and send ``S``), the figure bandwidth divides.
    ``phase``: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"other"`` — when in the step it
    was issued, which decides what compute it can overlap.
    """

    kind: str
    axis: str
    group_size: int
    payload_bytes: int
    wire_bytes: int
    phase: str = "other"

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def ring_wire_bytes(kind: str, payload_bytes: int, group_size: int) -> int:
    """Bytes one rank sends for a collective of ``payload_bytes`` over ``group_size`` ranks (see
    :class:`CollectiveRecord`); 0 for a group of one."""
    n = group_size
    if n <= 1 or kind == "barrier":
        return 0
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return payload_bytes * (n - 1) // n
    if kind == "all_reduce":
        return 2 * payload_bytes * (n - 1) // n
    return payload_bytes  # broadcast, reduce, send, recv: the whole tensor crosses one link


@attrs.frozen
class CollectiveSummary:
    """Collectives of one kind on one axis, summed over a step."""

    kind: str
    axis: str
    group_size: int
    count: int
    payload_bytes: int
    wire_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def summarise_collectives(records: Iterable[CollectiveRecord]) -> list[CollectiveSummary]:
    """Per (axis, kind): count and bytes, in a stable order (axis, then kind)."""
    totals: dict[tuple[str, str, int], list[int]] = {}
    for record in records:
        entry = totals.setdefault((record.axis, record.kind, record.group_size), [0, 0, 0])
        entry[0] += 1
        entry[1] += record.payload_bytes
        entry[2] += record.wire_bytes
    return [CollectiveSummary(kind=kind, axis=axis, group_size=size, count=count, payload_bytes=payload, wire_bytes=wire)
            for (axis, kind, size), (count, payload, wire) in sorted(totals.items())]


@attrs.frozen
class OpCost:
    """The compute of one operator (or of identical operators folded together, ``count``):
    ``flops`` per call (torch's ``FlopCounterMode`` formulas; 0 for elementwise ops), ``bytes``
    per call read and written (its tensor inputs and outputs), the ``dtype`` it computes in
    (which peak applies) and whether it is a matrix multiply (tensor cores) or not."""

    name: str
    flops: int
    bytes: int
    dtype: str
    matmul: bool
    count: int = 1


__all__ = ["COLLECTIVE_KINDS", "CollectiveRecord", "CollectiveSummary", "OpCost", "ring_wire_bytes",
           "summarise_collectives"]
