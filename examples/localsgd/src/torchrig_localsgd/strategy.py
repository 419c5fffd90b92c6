"""The ``localsgd`` strategy's runtime: local SGD (Lin et al., "Don't Use Large Mini-Batches, Use
Local SGD", 2020; torch's ``PeriodicModelAverager``).

Every rank keeps a full copy of the model, as under DDP, but gradients are *not* all-reduced:
each rank steps its optimizer on its own data, and every ``sync_every`` optimizer steps the
parameters (and floating buffers) are averaged across ranks — one all-reduce per K steps instead
of one per step. With ``sync_every: 1`` and plain SGD this equals synchronous data parallelism.

How it maps onto torchrig's hooks (only the public plugin API is used):

* ``torchrig_strategy_capabilities`` — owns nothing; every rank is a data-parallel rank (the core
  shards the data);
* ``torchrig_prepare_model`` — moves the model to the device and broadcasts rank 0's parameters
  and buffers, so every rank starts from the same model;
* ``torchrig_strategy_step_plan`` — wraps the ``optimizer_step`` slot: step, then count, and
  average on every K-th step (a plain callable: nothing goes through pluggy per step);
* ``torchrig_save_strategy_state`` / ``torchrig_load_strategy_state`` — between averages the
  ranks' parameters and optimizer states differ, so every rank writes and reads its own file
  (``localsgd_rank<r>.pt``, with the step counters): a resume continues exactly where it stopped;
* ``torchrig_full_state_dict`` — ``save_model`` exports the average of the ranks' weights.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torchrig.plugin import (
    Capabilities,
    PlanningUnsupported,
    PreparedModel,
    RunContext,
    StashKey,
    StepPlanBuilder,
    hookimpl,
)

from torchrig_localsgd.options import LocalSGDKwargs


@attrs.define(eq=False)
class _Group:
    """What one optimizer's steps average: its parameters, and the model's floating buffers."""

    tensors: list[Any]
    steps: int = 0


@attrs.define(eq=False)
class Averager:
    """Counts optimizer steps per optimizer and averages across ranks on every K-th."""

    world_size: int
    sync_every: int
    average_buffers: bool
    groups: dict[int, _Group] = attrs.field(factory=dict)
    #: Averages performed (all optimizers), for tests and reports.
    averages: int = 0

    def add(self, model: Any, optimizers: Sequence[Any]) -> None:
        buffers = [b for b in model.buffers() if b.is_floating_point()] if self.average_buffers else []
        for index, optimizer in enumerate(optimizers):
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self.groups[id(optimizer)] = _Group(tensors=params + (buffers if index == 0 else []))

    def after_step(self, optimizer: Any) -> None:
        """Called after every optimizer step, applied or skipped (an fp16 overflow may skip it on one
        rank only: counting every call keeps the ranks' collectives aligned)."""
        group = self.groups.get(id(optimizer))
        if group is None or self.world_size <= 1:
            return
        group.steps += 1
        if group.steps % self.sync_every == 0:
            average_(group.tensors, self.world_size)
            self.averages += 1


KEY: StashKey[Averager] = StashKey("localsgd.averager")

#: Why ``torchrig plan`` does not plan a local SGD run (the planning contract of ``torchrig_prepare_model``).
PLANNING_REFUSAL = (
    "strategy 'localsgd' is not planned: its prepare broadcasts rank 0's parameters, and its traffic is one "
    "all-reduce of every parameter once per sync_every optimizer steps, which the plan's single recorded step "
    "cannot show (it would report either none or a whole average per step); plan the same model with "
    "distributed_type MULTI_GPU (ddp) for its layout and memory")


def _buckets(tensors: Iterable[Any]) -> dict[tuple[Any, Any], list[Any]]:
    out: dict[tuple[Any, Any], list[Any]] = {}
    for tensor in tensors:
        out.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    return out


@torch.no_grad()
def average_(tensors: Sequence[Any], world_size: int) -> None:
    """Replace each tensor by its mean across ranks: one all-reduce per dtype and device."""
    for bucket in _buckets(tensors).values():
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        dist.all_reduce(flat)
        flat.div_(world_size)
        offset = 0
        for tensor in bucket:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


@torch.no_grad()
def broadcast_(tensors: Sequence[Any], src: int = 0) -> None:
    """Give every rank rank ``src``'s values: one broadcast per dtype and device."""
    for bucket in _buckets(tensors).values():
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        dist.broadcast(flat, src)
        offset = 0
        for tensor in bucket:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def _averager(run: RunContext) -> Averager:
    averager = run.stash.get(KEY)
    if averager is None:
        options = run.section(LocalSGDKwargs)  # typed, each default declared once: on the options class
        averager = Averager(world_size=run.cluster.world_size, sync_every=options.sync_every,
                            average_buffers=options.average_buffers)
        run.stash[KEY] = averager
    return averager


def _file(rank: int) -> str:
    return f"localsgd_rank{rank}.pt"


class LocalSGDStrategy:
    @hookimpl
    def torchrig_strategy_capabilities(self, run: RunContext) -> Capabilities:
        return Capabilities(data_parallel_size=run.cluster.world_size, data_parallel_rank=run.cluster.rank)

    @hookimpl
    def torchrig_prepare_model(
        self, run: RunContext, model: Any, optimizers: Sequence[Any], schedulers: Sequence[Any], device_placement: bool
    ) -> PreparedModel:
        if run.planning:  # before the model is moved or broadcast
            raise PlanningUnsupported(PLANNING_REFUSAL)
        assert run.device is not None
        if device_placement:
            model.to(run.device.device)
        if run.cluster.world_size > 1:
            broadcast_([*model.parameters(), *model.buffers()])
        _averager(run).add(model, optimizers)
        return PreparedModel(model=model, unwrapped=model, optimizers=list(optimizers), schedulers=list(schedulers))

    @hookimpl
    def torchrig_strategy_step_plan(self, run: RunContext, plan: StepPlanBuilder) -> None:
        step = plan.get("optimizer_step")  # plain, or the precision plugin's (fp16: through the scaler)
        averager = _averager(run)

        def optimizer_step(optimizer: Any) -> bool:
            applied = step(optimizer)
            averager.after_step(optimizer)
            return applied

        plan.set("optimizer_step", optimizer_step)

    @hookimpl
    def torchrig_save_strategy_state(
        self, run: RunContext, prepared: Sequence[PreparedModel], directory: str, writer: Any
    ) -> list[str]:
        averager = _averager(run)
        state = {
            "models": [item.unwrapped.state_dict() for item in prepared],
            "optimizers": [[optimizer.state_dict() for optimizer in item.optimizers] for item in prepared],
            "steps": [[averager.groups[id(o)].steps if id(o) in averager.groups else 0 for o in item.optimizers]
                      for item in prepared],
        }
        writer.save_torch(state, _file(run.cluster.rank))
        return []  # files written through the writer are recorded by it

    @hookimpl
    def torchrig_load_strategy_state(
        self, run: RunContext, prepared: Sequence[PreparedModel], directory: str, manifest: Mapping[str, Any]
    ) -> bool:
        saved_world = manifest.get("world_size")
        if saved_world is not None and int(saved_world) != run.cluster.world_size:
            raise RuntimeError(
                f"strategy 'localsgd': this checkpoint was saved by {saved_world} processes and this run has "
                f"{run.cluster.world_size}; local SGD keeps each rank's parameters and optimizer state, so resume it "
                f"with {saved_world} processes (or export averaged weights with save_model and start from them)")
        path = os.path.join(directory, _file(run.cluster.rank))
        if not os.path.exists(path):
            raise RuntimeError(f"strategy 'localsgd': {directory} has no {_file(run.cluster.rank)}; it was not saved "
                               "by the localsgd strategy (load it with the strategy that saved it)")
        assert run.device is not None
        state = torch.load(path, map_location=run.device.device, weights_only=True)
        if len(state["models"]) != len(prepared):
            raise RuntimeError(f"strategy 'localsgd': {path} holds {len(state['models'])} models, this run prepared "
                               f"{len(prepared)}")
        averager = _averager(run)
        for item, model_state, optimizer_states, steps in zip(prepared, state["models"], state["optimizers"],
                                                              state["steps"]):
            item.unwrapped.load_state_dict(model_state)
            for optimizer, optimizer_state, count in zip(item.optimizers, optimizer_states, steps):
                optimizer.load_state_dict(optimizer_state)
                if id(optimizer) in averager.groups:
                    averager.groups[id(optimizer)].steps = int(count)
        return True

    @hookimpl
    def torchrig_full_state_dict(self, run: RunContext, prepared: PreparedModel) -> dict[str, Any]:
        """The ranks' average (collective: every rank calls it), whatever step the run is at."""
        state = {name: value.detach().clone() for name, value in prepared.unwrapped.state_dict().items()}
        if run.cluster.world_size > 1:
            average_([value for value in state.values() if value.is_floating_point()], run.cluster.world_size)
        return state


__all__ = ["Averager", "LocalSGDStrategy", "average_", "broadcast_"]
