"""The rendezvous of a launch: how the nodes of one attempt meet and agree on a master address.

Two handlers around torch elastic's: :class:`SingleNodeRendezvous` (one machine, no round to
wait for, a fresh store per attempt) and :class:`MachineRankRendezvous` (c10d, with node rank =
``--machine_rank`` and a fresh master port per round). Separate from the agent
(:mod:`torchrig.launch.elastic`) because which peers meet where is a question of its own, and the
reason restarts get a fresh port lives here (see that module's docstring for the measurement).

Imports torch: only called from the ``torchrig_launch`` hook.
"""

from __future__ import annotations

import datetime
import socket
import sys
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import (
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from torchrig.plugin.types import LaunchPlan

#: No machine is waiting to join (:meth:`MachineRankRendezvous.num_nodes_waiting`).
_NOT_WAITING = object()


def free_port(host: str = "") -> int:
    """A port nobody listens on right now (bind to 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class SingleNodeRendezvous(RendezvousHandler):
    """One machine: no peer to wait for, so no c10d rendezvous round (whose join path sleeps a
    random fraction of a second). Every attempt gets a new TCPStore, hosted by the agent on a
    fresh loopback port before any worker starts: the workers connect to a store that is already
    listening (no connect retries, as with torchrun), and a restart never meets the keys of the
    attempt before it (the reason torchrig does not share one store across attempts)."""

    def __init__(self, run_id: str, first_port: int = 0, timeout_s: float = 900.0) -> None:
        self.run_id = run_id
        self.first_port = first_port  # main_process_port, when given: the first attempt's master port
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store: Any = None
        self._attempt = 0
        self._closed = False

    def next_rendezvous(self) -> RendezvousInfo:
        from torch.distributed import PrefixStore, TCPStore

        self._attempt += 1
        port = self.first_port if self._attempt == 1 else 0
        self._store = TCPStore("127.0.0.1", port, None, True, self.timeout, wait_for_workers=False,
                               multi_tenant=True)
        store = PrefixStore(self.run_id, self._store)
        return RendezvousInfo(store, 0, 1, RendezvousStoreInfo("127.0.0.1", int(self._store.port)))

    def get_backend(self) -> str:
        return "torchrig-single-node"

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers' process group uses this attempt's store (they connect as clients)

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        self._store = None
        return True


class MachineRankRendezvous(RendezvousHandler):
    """A c10d rendezvous whose node ranks are the machines' ``--machine_rank`` and whose
    master port is new for every round (so every restart gets a fresh one).

    Elastic (``elastic=True``, ``--num_machines MIN:MAX``): a round may hold any MIN..MAX of the
    machines, so a fixed ``--machine_rank`` can leave holes (machine 0 gone, 1 left). There the
    node rank is the one the c10d round hands out (0..size-1, in the order the nodes joined) and
    node 0 of the round names the master address; ``--machine_rank`` only says which machine
    hosts the rendezvous store (machine 0: if it leaves, the survivors cannot meet again)."""

    def __init__(self, inner: RendezvousHandler, machine_rank: int, master_addr: str, *,
                 elastic: bool = False) -> None:
        self.inner = inner
        self.machine_rank = machine_rank
        self.master_addr = master_addr
        self.elastic = elastic
        #: What the workers last committed (:meth:`grow_at_commit`); None: grow at once, as torch elastic does.
        self._last_commit: Callable[[], str | None] | None = None
        self._commit_when_seen: object = _NOT_WAITING

    def grow_at_commit(self, last_commit: Callable[[], str | None]) -> None:
        """Defer growing to the next checkpoint boundary: a machine waiting to join is reported to
        the agent (which then restarts the workers into a bigger round) only once ``last_commit()``
        — what this node's ranks last committed — differs from what it was when the machine was
        first seen waiting. The workers resume from that commit, so no step is trained twice by
        more than the agent's monitor interval; a run that never commits again never grows."""
        self._last_commit = last_commit

    def next_rendezvous(self) -> RendezvousInfo:
        self._commit_when_seen = _NOT_WAITING
        info = self.inner.next_rendezvous()
        store, size = info.store, info.world_size
        node_rank = info.rank if self.elastic else self.machine_rank
        if not self.elastic:
            store.set(f"torchrig/machine_rank/{info.rank}", str(self.machine_rank))
            claimed = sorted(int(store.get(f"torchrig/machine_rank/{i}").decode()) for i in range(size))
            if claimed != list(range(size)):
                raise RendezvousError(
                    f"the {size} machines joined with machine ranks {claimed}; each of 0..{size - 1} must be used "
                    "exactly once (check --machine_rank on every machine)")
        if node_rank == 0:
            store.set("torchrig/master", f"{self.master_addr}:{free_port()}")
        addr, _, port = store.get("torchrig/master").decode().rpartition(":")
        return RendezvousInfo(store, node_rank, size, RendezvousStoreInfo(addr, int(port)))

    # everything else is the c10d handler's
    def get_backend(self) -> str:
        return self.inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """The machines waiting to join; with :meth:`grow_at_commit`, 0 until the ranks commit a
        checkpoint after the first of them was seen (the agent restarts the workers on > 0)."""
        waiting = self.inner.num_nodes_waiting()
        if self._last_commit is None:
            return waiting
        if waiting <= 0:
            self._commit_when_seen = _NOT_WAITING
            return waiting
        commit = self._last_commit()
        if self._commit_when_seen is _NOT_WAITING:
            self._commit_when_seen = commit
            print(f"torchrig launch: {waiting} machine(s) waiting to join; the workers grow into them after their "
                  "next checkpoint commit", file=sys.stderr, flush=True)
            return 0
        if commit == self._commit_when_seen:
            return 0
        print(f"torchrig launch: checkpoint {commit} committed; restarting the workers into a round with the "
              f"{waiting} waiting machine(s)", file=sys.stderr, flush=True)
        return waiting

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        return self.inner.shutdown()


def rendezvous_handler(plan: LaunchPlan) -> tuple[RendezvousHandler, str | None, int | None]:
    """This node's rendezvous handler for ``plan``, and the master address and port elastic's
    ``WorkerSpec`` needs (only a static rendezvous names them up front)."""
    backend = plan.rdzv_backend or "c10d"
    single = plan.num_nodes == 1
    if backend == "local":
        port = int(plan.rdzv_endpoint.rpartition(":")[2] or 0)
        return SingleNodeRendezvous(f"{plan.run_id}-{uuid.uuid4().hex[:8]}", first_port=port), None, None
    endpoint = plan.rdzv_endpoint
    host = endpoint.rpartition(":")[0] or "127.0.0.1"
    master_addr = plan.master_addr or ("127.0.0.1" if single else host)
    configs: dict[str, Any] = dict(plan.rdzv_configs)
    spec_addr = spec_port = None
    if backend == "c10d":
        configs.setdefault("is_host", plan.node_rank == 0)
    elif backend == "static":
        configs.setdefault("rank", plan.node_rank)
        spec_addr, spec_port = host, int(endpoint.rpartition(":")[2])
    params = RendezvousParameters(
        backend=backend, endpoint=endpoint,
        run_id=plan.run_id if not single else f"{plan.run_id}-{uuid.uuid4().hex[:8]}",
        min_nodes=plan.min_nodes or plan.num_nodes, max_nodes=plan.num_nodes,
        local_addr="127.0.0.1" if single else (master_addr if plan.node_rank == 0 else None), **configs,
    )
    handler = rdzv_registry.get_rendezvous_handler(params)
    if backend == "c10d":
        elastic = plan.min_nodes is not None and plan.min_nodes < plan.num_nodes
        handler = MachineRankRendezvous(handler, plan.node_rank, master_addr, elastic=elastic)
    return handler, spec_addr, spec_port



__all__ = ["MachineRankRendezvous", "SingleNodeRendezvous", "free_port", "rendezvous_handler"]
