"""The ``ft`` strategy's runtime: data parallelism across torchft replica groups.

Each torchrig job (one process here) is one *replica group*. Its ``torchft.Manager`` asks the
lighthouse, at every step, which groups are alive (the quorum), reconfigures a process group over
exactly those, all-reduces gradients over it, and commits the optimizer step only when the
group's processes agree that the quorum's all-reduce succeeded and enough groups (``min_replicas``)
took part (torchft's ``should_commit``: a vote inside the group, not across groups). A group that dies is left out of the next
quorum: the others keep stepping without restarting. A group that (re)joins is behind: torchft
sends it a live peer's state (the model, the optimizer, its schedulers and torchft's step
counter) over its checkpoint transport, and it continues from there.

How that maps onto torchrig's hooks (only the public plugin API is used):

* ``torchrig_configure`` — refuses a replica group of more than one process (gradients would
  also have to be reduced inside the group, which torchft's DDP does not do);
* ``torchrig_prepare_model`` — builds the ``Manager`` (gloo on the CPU, NCCL on CUDA) with
  ``ft_config``, registers the model's and optimizer's state for live recovery, wraps the model in
  torchft's ``DistributedDataParallel`` (its communication hook is the manager's all-reduce);
* ``torchrig_strategy_step_plan`` — ``backward`` starts the step's quorum before the first
  backward of a step (torchft's ``OptimizerWrapper.zero_grad`` does it in ``zero_grad``; a loop
  may call that after ``step``), ``optimizer_step`` steps only when ``should_commit()`` says so and
  otherwise reports a skipped step (the scheduler does not advance);
* ``torchrig_checkpoint_state`` — torchft's step counter goes into every checkpoint (torchft asks
  for it: a resumed group with a stale step would be healed backwards);
* ``torchrig_unconfigure`` — shuts the manager down.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import attrs
import torch
from torch.distributed import TCPStore
from torchft.ddp import DistributedDataParallel
from torchft.manager import Manager
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL
from torchrig.plugin import (
    Capabilities,
    PlanningUnsupported,
    PreparedModel,
    RunContext,
    StashKey,
    StepPlanBuilder,
    TorchrigError,
    hookimpl,
)

from torchrig_ft.constants import SECTION
from torchrig_ft.options import FTKwargs


@attrs.define(eq=False)
class ReplicaGroup:
    """This process's torchft manager and the state a rejoining peer receives from it."""

    options: FTKwargs
    manager: Manager | None = None
    #: The replica group's own rendezvous store (the Manager's ``store_addr``/``store_port``).
    store: Any = None
    model: Any = None
    optimizer: Any = None
    schedulers: list[Any] = attrs.field(factory=list)
    #: Whether this step's quorum was asked for (reset when the step is committed or dropped).
    quorum_started: bool = False

    def state_dict(self) -> dict[str, Any]:
        """What a recovering peer loads: called by torchft on its quorum thread while it serves us."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "schedulers": [scheduler.state_dict() for scheduler in self.schedulers]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """A live peer's state, applied by torchft on the training thread before the step commits."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for scheduler, scheduler_state in zip(self.schedulers, state["schedulers"]):
            scheduler.load_state_dict(scheduler_state)

    def start_step(self) -> None:
        if self.manager is not None and not self.quorum_started:
            self.manager.start_quorum()
            self.quorum_started = True

    def commit(self) -> bool:
        """torchft's ``should_commit``: True when this step's all-reduce over the quorum succeeded and
        enough replica groups took part."""
        assert self.manager is not None
        self.start_step()
        self.quorum_started = False
        return bool(self.manager.should_commit())

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None


KEY: StashKey[ReplicaGroup] = StashKey("ft.replica_group")


class FTStrategy:
    @hookimpl
    def torchrig_configure(self, run: RunContext) -> None:
        if run.cluster.world_size > 1:
            raise TorchrigError(
                f"strategy 'ft' runs one process per replica group, but this group has {run.cluster.world_size} "
                "processes: torchft's DistributedDataParallel reduces gradients across replica groups only, not "
                "inside one; launch each replica group with --num_processes 1 (one job per group, each with its own "
                f"{SECTION}.replica_id), or use strategy 'ddp' for a job that restarts as a whole")
        run.stash[KEY] = ReplicaGroup(options=run.section(FTKwargs))

    @hookimpl
    def torchrig_unconfigure(self, run: RunContext) -> None:
        group = run.stash.get(KEY)
        if group is not None:
            group.shutdown()

    @hookimpl
    def torchrig_strategy_capabilities(self, run: RunContext) -> Capabilities:
        return Capabilities(replicated_parameters=True, data_parallel_size=run.cluster.world_size,
                            data_parallel_rank=run.cluster.rank)

    @hookimpl
    def torchrig_prepare_model(
        self, run: RunContext, model: Any, optimizers: Sequence[Any], schedulers: Sequence[Any], device_placement: bool
    ) -> PreparedModel:
        if run.planning:
            raise PlanningUnsupported("strategy 'ft': torchft's replica groups need a live lighthouse and peers; "
                                      "plan the same model under strategy 'ddp', which communicates the same "
                                      "gradient all-reduce per step")
        assert run.device is not None
        device = run.device.device
        if device_placement:
            model.to(device)
        prepared = PreparedModel(model=model, unwrapped=model, optimizers=list(optimizers), schedulers=list(schedulers))
        if not any(p.requires_grad for p in model.parameters()):
            return prepared  # a frozen model (teacher, EMA): nothing to reduce, nothing to recover
        group = run.stash[KEY]
        if group.manager is not None or len(optimizers) != 1:
            raise TorchrigError(
                f"strategy 'ft' trains one model with one optimizer per run (this prepare() gives "
                f"{type(model).__name__} {len(optimizers)} optimizer(s)"
                f"{', after another trained model' if group.manager is not None else ''}): torchft commits one "
                "optimizer step per quorum; put the parameters in one optimizer (several param groups are fine)")
        group.model, group.optimizer, group.schedulers = model, optimizers[0], list(schedulers)
        group.manager, group.store = _start_manager(group, device)
        wrapped = DistributedDataParallel(group.manager, model)
        #: The manager, for scripts and tests: ``current_step()``, ``num_participants()``.
        wrapped.torchft_manager = group.manager
        prepared.model = wrapped
        return prepared

    @hookimpl
    def torchrig_strategy_step_plan(self, run: RunContext, plan: StepPlanBuilder) -> None:
        group = run.stash[KEY]
        plan.set("backward", _quorum_then(group, plan.get("backward")))
        plan.set("optimizer_step", _step_if_committed(group, plan.get("optimizer_step")))

    @hookimpl
    def torchrig_checkpoint_state(self, run: RunContext) -> Mapping[str, Any] | None:
        group = run.stash.get(KEY)
        return {"torchft_manager": group.manager} if group is not None and group.manager is not None else None


def _start_manager(group: ReplicaGroup, device: torch.device) -> tuple[Manager, Any]:
    """torchft's Manager for a one-process replica group, with its own rendezvous store."""
    options = group.options
    hostname = options.hostname or socket.gethostname()
    store = TCPStore(host_name=hostname, port=0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=options.timeout_s)
    process_group = ProcessGroupNCCL(timeout=timeout) if device.type == "cuda" else ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=process_group, load_state_dict=group.load_state_dict, state_dict=group.state_dict,
        min_replica_size=options.min_replicas, use_async_quorum=True, timeout=timeout,
        quorum_timeout=timedelta(seconds=options.quorum_timeout_s),
        connect_timeout=timedelta(seconds=options.connect_timeout_s),
        rank=0, world_size=1, store_addr=hostname, store_port=store.port,
        lighthouse_addr=options.lighthouse, replica_id=options.replica_id or None, hostname=hostname,
        init_sync=options.init_sync,
    )
    return manager, store


def _quorum_then(group: ReplicaGroup, backward: Callable[..., None]) -> Callable[..., None]:
    """The step's quorum is asked for before its first backward (it resolves while the gradients are
    computed; the all-reduce waits for it)."""

    def backward_in_quorum(loss: Any, **kwargs: Any) -> None:
        group.start_step()
        backward(loss, **kwargs)

    return backward_in_quorum


def _step_if_committed(group: ReplicaGroup, step: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """Step only what the quorum committed; a dropped step (a peer died mid all-reduce, too few
    replica groups) is reported as skipped, so the scheduler does not advance either."""

    def optimizer_step(optimizer: Any) -> bool:
        if group.manager is None:
            return step(optimizer)
        return step(optimizer) if group.commit() else False

    return optimizer_step


__all__ = ["KEY", "FTStrategy", "ReplicaGroup"]
