"""``FTKwargs``: the ``ft_config`` section — where the torchft lighthouse is, which replica group this
job is, and how long torchft waits before it gives up on a peer.

Torch-free: the manifest and the CLI import it; the runtime turns it into ``torchft.Manager(...)``
arguments.
"""

from __future__ import annotations

import attrs
from torchrig.plugin import KwargsHandler, at_least, option


@attrs.frozen(kw_only=True)
class FTKwargs(KwargsHandler):
    """torchft's ``Manager`` arguments that a run chooses; the rest are torchft's defaults."""

    lighthouse: str = option("", help="address of the torchft lighthouse every replica group joins, e.g. "
                                      "http://host:29510 (start one with `torchft_lighthouse --min_replicas 1 "
                                      "--bind [::]:29510`); required")
    replica_id: str = option("", help="this replica group's name, shown by the lighthouse (torchft appends a "
                                      "fresh uuid on every start, so a restarted group is a new member); "
                                      "default: the uuid alone")
    min_replicas: int = option(1, help="commit a step only when at least this many replica groups took part "
                                       "in it (torchft's min_replica_size)", validator=at_least(1))
    timeout_s: float = option(60.0, help="seconds before a collective, a should-commit vote or a live "
                                         "recovery transfer is given up (the step is then not committed)",
                              validator=at_least(0.1))
    quorum_timeout_s: float = option(60.0, help="seconds to wait for the lighthouse to form a quorum",
                                     validator=at_least(0.1))
    connect_timeout_s: float = option(60.0, help="seconds to wait when connecting to the lighthouse or a "
                                                 "peer's manager", validator=at_least(0.1))
    init_sync: bool = option(True, help="on the first step, every replica group takes the parameters of "
                                        "one group (set False only if every group initialises identically)")
    hostname: str = option("", help="the address peers reach this group's manager and recovery server at; "
                                    "default: this machine's hostname")


__all__ = ["FTKwargs"]
