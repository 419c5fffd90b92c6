"""The ``mpi`` cluster environment (priority 30): its detection, and ``torchrig launch --cluster mpi``'s
hand-off to ``mpirun``.

Every rank reads its place from the MPI launcher's variables (:class:`MPICluster`; no MPI library is
imported). The plugin's runtime object, :class:`MPILauncher`, adds the launcher's hooks: with
``cluster: mpi`` (and not already an MPI rank) ``torchrig launch`` runs :func:`mpirun_line` through
:mod:`torchrig.launch.handoff`, which forwards signals and writes ``run_status.json``. Torch-free.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
from collections.abc import Mapping, Sequence

from torchrig.builtins.clusters.cluster_environment import check_ranks, int_var, port_var
from torchrig.builtins.clusters.handoff_options import MPIOptions, plan_section
from torchrig.launch.handoff import PROG, HandoffRefused, refuse, run_forwarding
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import ClusterInfo, LaunchPlan


class _MPIFlavour:
    __slots__ = ("name", "rank", "size", "local_rank", "local_size", "export_hint")

    def __init__(self, name: str, rank: str, size: str, local_rank: str, local_size: str, export_hint: str) -> None:
        self.name, self.rank, self.size = name, rank, size
        self.local_rank, self.local_size, self.export_hint = local_rank, local_size, export_hint


MPI_FLAVOURS = (
    _MPIFlavour("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE", "mpirun -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<free port> ..."),
    _MPIFlavour("MVAPICH2", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                "MV2_COMM_WORLD_LOCAL_SIZE", "mpirun_rsh ... MASTER_ADDR=<host of rank 0> MASTER_PORT=<free port> python ..."),
    _MPIFlavour("MPICH / Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                "mpiexec -genv MASTER_ADDR <host of rank 0> -genv MASTER_PORT <free port> ..."),
)


class MPICluster:
    """One process per MPI rank, started by ``mpirun``/``mpiexec`` (no MPI library is imported).

    - Open MPI: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
    - MVAPICH2: ``MV2_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
    - MPICH / Intel MPI (hydra): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.

    MPI does not say which node index a process is on (Open MPI's ``OMPI_COMM_WORLD_NODE_RANK``
    is a rank *within* the node, not the node's index), so ``node_rank = (rank - local_rank) //
    local_size`` and ``num_nodes = ceil(size / local_size)``: exact for the default placement
    (consecutive ranks fill a node: ``--map-by slot``, hydra's block placement) with the same
    number of ranks per node; informational otherwise (torchrig itself needs only the ranks,
    sizes and rendezvous). The rendezvous cannot be derived: ``MASTER_ADDR`` and
    ``MASTER_PORT`` must be exported to every rank (``mpirun -x``); when they are missing the
    plugin raises a ``ValueError`` saying what to export.
    """

    name = "mpi"

    @hookimpl
    def torchrig_detect_cluster(self, environ: Mapping[str, str]) -> ClusterInfo | None:
        return detect_mpi(environ)


def mpi_hands_off(plan: LaunchPlan, environ: Mapping[str, str]) -> bool:
    """``cluster: mpi`` configured, and this launcher is not itself an MPI rank (``mpirun torchrig launch``)."""
    return plan.cluster == "mpi" and mpi_rank_and_size(environ) is None


def mpi_rank_and_size(environ: Mapping[str, str]) -> tuple[str, str, str, str] | None:
    """``(rank var, rank, size var, size)`` of the first MPI launcher whose variables are set."""
    for flavour in MPI_FLAVOURS:
        if flavour.rank in environ:
            return flavour.rank, environ[flavour.rank], flavour.size, environ.get(flavour.size, "")
    return None


def detect_mpi(environ: Mapping[str, str]) -> ClusterInfo | None:
    """The mpi plugin's answer for ``environ`` (``None`` when no MPI launcher started it)."""
    flavour = next((f for f in MPI_FLAVOURS if f.rank in environ), None)
    if flavour is None:
        return None
    p = "mpi"
    rank = int_var(environ, flavour.rank, p)
    world_size = int_var(environ, flavour.size, p, minimum=1)
    check_ranks(p, (flavour.rank, rank), (flavour.size, world_size))
    missing_local = [n for n in (flavour.local_rank, flavour.local_size) if n not in environ]
    if missing_local:
        raise ValueError(
            f"mpi: {flavour.rank} is set ({flavour.name}) but {' and '.join(missing_local)} "
            f"{'is' if len(missing_local) == 1 else 'are'} not, so this process's local rank is unknown; "
            "start the ranks with the MPI launcher (mpirun / mpiexec), or with srun under the slurm plugin"
        )
    local_rank = int_var(environ, flavour.local_rank, p)
    local_world_size = int_var(environ, flavour.local_size, p, minimum=1)
    check_ranks(p, (flavour.local_rank, local_rank), (flavour.local_size, local_world_size))
    if local_world_size > world_size:
        raise ValueError(f"mpi: {flavour.local_size}={local_world_size} exceeds {flavour.size}={world_size}")
    num_nodes = -(-world_size // local_world_size)
    node_rank = max(0, rank - local_rank) // local_world_size

    master_addr: str | None = None
    master_port: int | None = None
    if world_size > 1:
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(n, "").strip()]
        if missing:
            raise ValueError(
                f"mpi: this process is rank {rank} of {world_size} started by {flavour.name} ({flavour.rank}), "
                f"but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: torchrig needs the "
                "address and port of rank 0 to join the process group. Export both to every rank, e.g. "
                f"`{flavour.export_hint}` (torchrig.builtins.clusters.mpi.mpirun_command builds the Open MPI line)"
            )
        master_addr = environ["MASTER_ADDR"].strip()
        master_port = port_var(environ, "MASTER_PORT", p)
    return ClusterInfo(
        rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size,
        node_rank=node_rank, num_nodes=num_nodes, master_addr=master_addr, master_port=master_port, source="mpi",
    )


# --------------------------------------------------------------------------------------------
# Hand-off: torchrig launch --cluster mpi
# --------------------------------------------------------------------------------------------


def mpirun_command(
    nproc: int,
    command: Sequence[str],
    *,
    hosts: Sequence[str] | None = None,
    master_addr: str,
    master_port: int,
    extra: Sequence[str] = (),
) -> list[str]:
    """The Open MPI ``mpirun`` command line that starts ``nproc`` training processes.

    ``mpirun -np N [-H host:slots,...] -x MASTER_ADDR=<addr> -x MASTER_PORT=<port> -x PATH
    *extra *command`` (Open MPI syntax: ``-H`` takes ``host:slots`` entries, ``-x NAME=VALUE``
    sets a variable in every rank and ``-x NAME`` forwards the launcher's own). ``hosts`` entries
    are ``"host"`` or ``"host:slots"``; bare hosts share ``nproc`` evenly (it must divide) and
    the slots must cover ``nproc``. ``master_addr`` must be the host of rank 0 (the first host),
    reachable from every other. ``command`` is the user's command
    (:attr:`LaunchPlan.script_command`). MPICH / Intel MPI spell it
    ``mpiexec -n N -hosts ... -genv MASTER_ADDR ...``; pass their lines yourself.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"mpirun_command: nproc must be a positive integer, not {nproc!r}")
    if isinstance(command, str) or not command:
        raise ValueError("mpirun_command: command must be a non-empty list of arguments")
    if not isinstance(master_addr, str) or not master_addr.strip():
        raise ValueError("mpirun_command: master_addr must be the host name or address of rank 0")
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not 1 <= master_port <= 65535:
        raise ValueError(f"mpirun_command: master_port must be a TCP port (1-65535), not {master_port!r}")
    args = ["mpirun", "-np", str(nproc)]
    if hosts:
        args += ["-H", ",".join(_host_slots(list(hosts), nproc))]
    args += ["-x", f"MASTER_ADDR={master_addr.strip()}", "-x", f"MASTER_PORT={master_port}", "-x", "PATH"]
    return [*args, *extra, *command]


def _host_slots(hosts: list[str], nproc: int) -> list[str]:
    bare = [h for h in hosts if ":" not in h]
    if bare and nproc % len(hosts):
        raise ValueError(f"mpirun_command: {nproc} processes do not divide evenly over {len(hosts)} hosts; "
                         "give each host its slots as 'host:slots'")
    entries, total = [], 0
    for host in hosts:
        name, sep, slots_text = host.partition(":")
        if not name.strip():
            raise ValueError(f"mpirun_command: empty host name in {host!r}")
        if sep:
            try:
                slots = int(slots_text)
            except ValueError:
                raise ValueError(f"mpirun_command: bad slot count in {host!r} (expected host:slots)") from None
            if slots < 1:
                raise ValueError(f"mpirun_command: bad slot count in {host!r} (expected host:slots)")
        else:
            slots = nproc // len(hosts)
        entries.append(f"{name.strip()}:{slots}")
        total += slots
    if total < nproc:
        raise ValueError(f"mpirun_command: the hosts offer {total} slots for {nproc} processes")
    return entries


#: The rendezvous address may also be an IPv6 address (with a ``%zone``).
_ADDRESS = re.compile(r"[A-Za-z0-9_:\[][A-Za-z0-9_.:%\[\]-]*")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def mpirun_line(plan: LaunchPlan, *, port: int | None = None) -> list[str]:
    """``mpirun`` for every rank of the plan: ``num_processes`` ranks on ``mpi.hosts`` (default:
    here), rendezvous on the first host (``main_process_ip``/``main_process_port`` when set),
    and the variables ``torchrig launch`` hands its workers forwarded with ``-x``."""
    options = plan_section(plan, MPIOptions)
    hosts = list(options.hosts)
    first = hosts[0].partition(":")[0] if hosts else "127.0.0.1"
    main_ip = plan.config.get("main_process_ip") if plan.config is not None else None
    addr = plan.master_addr or main_ip or first
    if not _ADDRESS.fullmatch(addr) or addr.startswith("-"):
        raise HandoffRefused(f"main_process_ip = {addr!r} is not a host name or address: mpirun exports it to "
                             "every rank as MASTER_ADDR; give the name or address of the first host")
    endpoint_port = int(plan.rdzv_endpoint.rpartition(":")[2] or 0)
    master_port = port or endpoint_port or _free_port()
    forwarded = [arg for key in sorted(plan.env) for arg in ("-x", key)]
    nproc = plan.nproc_per_node * plan.num_nodes
    if hosts:
        try:
            _host_slots(hosts, nproc)
        except ValueError as exc:
            raise HandoffRefused(f"mpi.hosts {hosts!r} cannot hold num_processes {nproc}: "
                                 f"{str(exc).removeprefix('mpirun_command: ')}") from None
    return mpirun_command(nproc, plan.script_command, hosts=hosts or None, master_addr=addr, master_port=master_port,
                          extra=[*forwarded, *options.mpirun_args])


def describe_mpi(plan: LaunchPlan) -> str:
    """``--dry-run``: the ``mpirun`` line, shell-quoted, to the end of the output (pasting it runs the same
    argv; its port is picked again at launch unless ``main_process_port`` is set)."""
    port = "" if plan.rdzv_endpoint.rpartition(":")[2] not in ("", "0") else (
        " (MASTER_PORT is picked again at launch: set main_process_port to fix it)")
    return f"  MPI: `{PROG}` would start every rank with mpirun{port}:\n  {shlex.join(mpirun_line(plan))}"


class MPILauncher(MPICluster):
    """The mpi plugin: detection (inherited) and the hand-off to ``mpirun``."""

    @hookimpl
    def torchrig_launch(self, plan: LaunchPlan) -> int | None:
        """With ``cluster: mpi`` (and not already an MPI rank): every rank started by ``mpirun``."""
        if not mpi_hands_off(plan, os.environ):
            return None
        try:
            return run_mpirun(plan)
        except HandoffRefused as exc:
            return refuse(plan, "mpirun", exc)

    @hookimpl
    def torchrig_describe_launch(self, plan: LaunchPlan) -> str | None:
        return describe_mpi(plan) if mpi_hands_off(plan, os.environ) else None


def run_mpirun(plan: LaunchPlan) -> int:
    command = mpirun_line(plan)
    if shutil.which(command[0]) is None:
        raise FileNotFoundError("mpirun is not on PATH: install Open MPI (Debian: openmpi-bin) or drop "
                                "`--cluster mpi` to start the workers with torch elastic")
    return run_forwarding(plan, command, what="mpirun")


__all__ = ["MPI_FLAVOURS", "MPICluster", "MPILauncher", "describe_mpi", "detect_mpi", "mpi_hands_off", "mpi_rank_and_size",
           "mpirun_command", "mpirun_line", "run_mpirun"]
