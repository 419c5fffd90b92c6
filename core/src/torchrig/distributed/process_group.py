"""The default process group's life in a run: adopted when it exists before the run starts,
released at interpreter exit when torchrig created it.

Ray Train's ``TorchTrainer`` creates the group before the training function runs; a user or
another framework may call ``dist.init_process_group`` before ``Accelerator()``; a second
Accelerator in one process finds the first one's group. torchrig never initialises a second
group then: :func:`adopt_existing_group` (called by :func:`torchrig.host.runtime.start_run` after the
device is claimed, before ``torchrig_init_process_group``) checks the group against the run and
records it, and the ``torchrig_init_process_group`` implementations see ``dist.is_initialized()``
and create nothing.

Checked, every mismatch in one :class:`~torchrig.errors.ConfigError` naming both values:

- world size and rank: the cluster environment's answer (``RANK``/``WORLD_SIZE``, Ray's context,
  ``cluster: local``...) against the group's;
- ``num_processes``, when set by the script, a run config file, the environment or a flag
  (the machine's default file describes the machine, not this job): against the world size of a
  group of several ranks (a one-rank group is what the single-process path makes, e.g. the
  DeepSpeed plugin's; ``python train.py`` runs one process whatever ``num_processes`` says);
- the backend: ``init_process_group_kwargs.backend`` when set, else the device's (cuda needs
  ``nccl``, the CPU ``gloo``), must be one the group has (``"cpu:gloo,cuda:nccl"`` has both).

The group's own timeout is kept (its creator chose it); groups torchrig creates later get the
configured one.

At interpreter exit (:func:`release_groups_at_exit`, after the live runs ended) a default group
torchrig created is destroyed, as Accelerate's ``end_training`` does; a group the script or Ray
created stays theirs to destroy. Then the GIL is released until the process's other threads
have settled. Why: gloo's worker threads free each finished collective's tensors themselves, and
a tensor whose Python object they own needs the GIL; when that happens after interpreter
finalization began, the thread is killed inside a destructor and the process aborts
("terminate called without an active exception", SIGABRT) after the script succeeded
(pytorch/pytorch#190489; seen here at the end of a 2-node torchrun job on a loaded machine).
Destroying the group does not stop those threads (torch's DDP keeps the group object alive
until finalization), so the only cure is to let them finish while the interpreter is alive.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import attrs

from torchrig.builtins.clusters.process_group import existing_default_group
from torchrig.config.resolve import Layer
from torchrig.errors import ConfigError
from torchrig.plugin.types import StashKey

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.host.run import RunContext


@attrs.frozen
class AdoptedGroup:
    """The default process group a run found already initialised."""

    #: The group object itself (``torch.distributed.group.WORLD``).
    group: Any
    #: ``torch.distributed.get_backend()``: ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``...
    backend: str
    rank: int
    world_size: int


#: The backend of torch's fake process group (nothing is communicated): a run that finds it plans
#: (``RunContext.planning``; :mod:`torchrig.estimate.fake_world` opens it).
FAKE_BACKEND = "fake"

#: ``run.stash[ADOPTED_GROUP]``: set when the run adopted an existing group.
ADOPTED_GROUP: StashKey[AdoptedGroup] = StashKey("core.adopted_group")

#: The default groups torchrig's runs created (weak: a destroyed, freed group drops out).
_CREATED_GROUPS: list[weakref.ref[Any]] = []
#: Whether a run of this process had a process group at all (created or adopted).
_HAD_GROUP = [False]

#: Configuration layers that state this job's intent (not the defaults, not the machine's file).
_INTENT_LAYERS = (Layer.ARGUMENT, Layer.CONFIG_FILE, Layer.ENV, Layer.FLAG)


def group_backends(backend: str) -> set[str]:
    """The backends of a group: ``"gloo"`` → ``{"gloo"}``; ``"cpu:gloo,cuda:nccl"`` → ``{"gloo", "nccl"}``."""
    return {part.split(":", 1)[-1].strip() for part in str(backend).split(",") if part.strip()}


def _source(run: RunContext, key: str) -> str | None:
    """Where ``key`` came from, if it states this job's intent."""
    origin = run.option_source(key)
    return str(origin) if origin is not None and origin.layer in _INTENT_LAYERS else None


def adopt_existing_group(run: RunContext) -> AdoptedGroup | None:
    """Check an existing default process group against ``run`` and record it; ``None`` when the
    process has none (the ``torchrig_init_process_group`` hook then creates one)."""
    existing = existing_default_group()
    if existing is None:
        return None
    import torch.distributed as dist  # already imported: existing_default_group found it in sys.modules

    rank, world_size = existing
    backend = str(dist.get_backend())
    backends = group_backends(backend)
    cluster = run.cluster
    problems = []
    if cluster.world_size != world_size:
        problems.append(f"world size: the cluster environment {cluster.source!r} says {cluster.world_size}, "
                        f"the existing process group has {world_size}")
    elif cluster.rank != rank:
        problems.append(f"rank: the cluster environment {cluster.source!r} says {cluster.rank}, "
                        f"the existing process group says {rank}")
    wanted = run.option("num_processes")
    origin = _source(run, "num_processes")
    if world_size > 1 and origin is not None and wanted is not None and int(wanted) != world_size:
        problems.append(f"num_processes={wanted} ({origin}), but the existing process group has world size {world_size}")
    configured = run.option("init_process_group_kwargs.backend")
    if configured:
        if not group_backends(str(configured)) <= backends:
            problems.append(f"init_process_group_kwargs.backend={configured!r} "
                            f"({_source(run, 'init_process_group_kwargs.backend') or 'configuration'}), "
                            f"but the existing process group's backend is {backend!r}")
    elif FAKE_BACKEND in backends:  # torch's fake group, which `torchrig plan` opens for any device
        run.planning = True
    elif run.device is not None and world_size > 1 and run.device.dist_backend not in backends:
        problems.append(f"the device {run.device.name!r} needs backend {run.device.dist_backend!r}, "
                        f"but the existing process group's backend is {backend!r}")
    if problems:
        raise ConfigError(problems, header=(
            f"this process already has a default process group (backend {backend!r}, rank {rank} of {world_size}) "
            "created before torchrig, and it does not match the run; torchrig adopts an existing group and never "
            "creates a second one, so make the configuration agree with the group (or create the group to match)"))
    adopted = AdoptedGroup(group=dist.group.WORLD, backend=backend, rank=rank, world_size=world_size)
    run.stash[ADOPTED_GROUP] = adopted
    return adopted


def record_group(run: RunContext) -> None:
    """After ``torchrig_init_process_group``: remember a default group this run created (one it
    did not adopt), so :func:`release_groups_at_exit` destroys it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    _HAD_GROUP[0] = True
    if ADOPTED_GROUP not in run.stash and not any(ref() is dist.group.WORLD for ref in _CREATED_GROUPS):
        _CREATED_GROUPS.append(weakref.ref(dist.group.WORLD))


def release_groups_at_exit(settle_limit_s: float = 2.0) -> None:
    """Destroy the default group torchrig created, if it still exists, then let gloo's worker
    threads finish freeing what they hold (see the module docstring for the abort this prevents)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not _HAD_GROUP[0]:
        return
    created = [ref() for ref in _CREATED_GROUPS]
    _CREATED_GROUPS.clear()
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if world is not None and any(group is world for group in created):
        dist.destroy_process_group()
    del created, world
    settle_threads(settle_limit_s)


def settle_threads(limit_s: float, step_s: float = 0.01) -> None:
    """Release the GIL until no other thread of this process is runnable twice in a row (Linux:
    each thread's state in ``/proc/self/task``), or ``limit_s`` passed; elsewhere sleep 0.1 s."""
    tasks = "/proc/self/task"
    if not os.path.isdir(tasks):
        time.sleep(min(0.1, limit_s))
        return
    me, quiet, deadline = str(threading.get_native_id()), 0, time.monotonic() + limit_s
    while quiet < 2 and time.monotonic() < deadline:
        time.sleep(step_s)
        quiet = quiet + 1 if not any(_runnable(tasks, tid) for tid in os.listdir(tasks) if tid != me) else 0


def _runnable(tasks: str, tid: str) -> bool:
    try:
        with open(f"{tasks}/{tid}/stat") as handle:
            stat = handle.read()
    except OSError:  # the thread ended
        return False
    return stat[stat.rindex(")") + 2:].startswith("R")


__all__ = ["ADOPTED_GROUP", "FAKE_BACKEND", "AdoptedGroup", "adopt_existing_group", "group_backends", "record_group",
           "release_groups_at_exit", "settle_threads"]
