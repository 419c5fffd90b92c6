"""``torchrig plan``: a run at its target scale, checked and predicted from one CPU process.

How (docs/plan.md): for each representative rank (:func:`representative_ranks`: the first rank of
the first, a middle and the last pipeline stage — the ranks whose layouts differ), a fake world of
the target size is opened (:mod:`torchrig.estimate.fake_world`), the real ``Accelerator`` is created
with the configuration a launched rank would resolve (the launch's flag layer and config file,
handed over by the same environment variables ``torchrig launch`` gives its workers), the model is
built on the meta device and ``prepare``d by the real strategy — the real ``DeviceMesh``, tensor
parallel plan, pipeline split and ``fully_shard`` — so every error the real run raises at
``prepare`` is raised here. Then one training step runs under ``FakeTensorMode`` (shapes and dtypes
real, nothing computed), recorded by :mod:`torchrig.estimate.recorder`: every collective the
strategy issues, the FLOPs and bytes of every operator, the memory held at the step's peak. The
roofline of :mod:`torchrig.estimate.step_time` turns those into time on the target GPU and network.

Errors do not stop the plan: each rank's error is kept with the rank and the stage it was raised
in, and the report lists every one.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from torchrig.accelerator import Accelerator
from torchrig.errors import PlanningUnsupported, TorchrigError
from torchrig.estimate.costs import CollectiveSummary, OpCost
from torchrig.estimate.fake_world import fake_world, world_environment
from torchrig.estimate.memory_model import build_on_meta, example_inputs, resolve_model, training_loss
from torchrig.estimate.recorder import StepRecorder, mesh_axes
from torchrig.estimate.script_run import ScriptError, ScriptTarget, run_until_prepared
from torchrig.estimate.step_memory import StepMemory, track_step_memory
from torchrig.utils.environment import patch_environment

#: Optimizers the plan can build for its step (their state is what it counts).
PLAN_OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-4),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-4),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-2),
    "none": lambda params: torch.optim.SGD(params, lr=0.0),  # no state: what the model and its step hold alone
}


class PlanError(TorchrigError):
    """The plan itself cannot run (a bad target or model); errors of the planned run are not raised,
    they are reported (:class:`RankPlan.error`)."""


@attrs.frozen
class PlanTarget:
    """Where the run is meant to run: ``num_machines`` × ``processes_per_machine`` ranks."""

    num_machines: int
    processes_per_machine: int

    @property
    def world_size(self) -> int:
        return self.num_machines * self.processes_per_machine

    def __attrs_post_init__(self) -> None:
        if self.num_machines < 1 or self.processes_per_machine < 1:
            raise PlanError(f"a target of {self.num_machines} machine(s) × {self.processes_per_machine} process(es): "
                            "both must be at least 1")


@attrs.frozen
class PlanInputs:
    """What to plan: ``model`` (a MODEL spec as ``torchrig estimate-memory`` takes it: ``module:function``,
    a config.json, a cached transformers name), the micro-batch per rank and sequence length of the step,
    the optimizer, and ``environment``: the variables a launched rank gets (the launch's flag layer,
    its config file), applied while each rank is planned."""

    model: str
    batch_size: int = 1
    seq_len: int = 2048
    optimizer: str = "adamw"
    environment: Mapping[str, str] = attrs.field(factory=dict)
    #: Ranks to plan instead of :func:`representative_ranks`.
    ranks: tuple[int, ...] | None = None
    #: Plan what this script prepares (run up to its ``prepare``: :mod:`torchrig.estimate.script_run`)
    #: instead of building ``model``; ``optimizer`` then only stands in for one the script prepares later.
    script: ScriptTarget | None = None


@attrs.frozen
class RankLayout:
    """Where a rank sits and what it holds after ``prepare``."""

    rank: int
    #: Mesh axis name → size (empty without a mesh).
    mesh: dict[str, int]
    #: Mesh axis name → this rank's coordinate.
    coordinates: dict[str, int]
    strategy: str
    mixed_precision: str
    #: Parameter elements this rank holds (its shards) and the model's total.
    local_parameters: int
    total_parameters: int
    #: Bytes of this rank's parameter shards, by dtype.
    parameter_bytes: dict[str, int]

    @property
    def role(self) -> str:
        """``"pp stage 2 of 4"``, or ``"every rank alike"`` without pipeline stages."""
        stages = self.mesh.get("pp", 1)
        if stages > 1:
            return f"pp stage {self.coordinates.get('pp', 0)} of {stages}"
        return "every rank alike"


@attrs.frozen
class StepRecording:
    """What one planned rank's training step did, recorded under ``FakeTensorMode``."""

    #: Collectives per (axis, kind): count and bytes.
    collectives: tuple[CollectiveSummary, ...]
    #: Every operator's cost (identical ones folded), all phases.
    ops: tuple[OpCost, ...]
    #: FLOPs per phase (forward, backward, optimizer).
    flops: dict[str, int]
    memory: StepMemory
    #: Mesh axis (and flattened axis, ``"world"``) → whether its process group spans machines.
    axes_across_nodes: dict[str, bool]
    #: Tokens of the batch this rank stepped on (micro-batch × sequence length).
    tokens: int
    seconds: float


@attrs.frozen
class RankPlan:
    """One planned rank: its layout and step recording, or the error its run would raise."""

    rank: int
    layout: RankLayout | None = None
    #: The recorded fake step (:class:`torchrig.estimate.recorder.StepRecording`), when it ran.
    step: Any = None
    #: ``"prepare: ConfigError: ..."`` when the rank's run fails; where, and what it raised.
    error: str | None = None
    #: Why the strategy could not lay the model out on the meta device
    #: (:class:`~torchrig.errors.PlanningUnsupported`): the plan falls back to its memory estimate.
    unsupported: str | None = None
    seconds: float = 0.0


@attrs.frozen
class PlanReport:
    target: PlanTarget
    inputs: PlanInputs
    ranks: tuple[RankPlan, ...]
    notes: tuple[str, ...] = ()

    @property
    def errors(self) -> list[str]:
        """Every distinct error, with the ranks that raise it."""
        by_message: dict[str, list[int]] = {}
        for plan in self.ranks:
            if plan.error:
                by_message.setdefault(plan.error, []).append(plan.rank)
        return [f"rank {', '.join(map(str, ranks))}: {message}" for message, ranks in by_message.items()]


def representative_ranks(mesh_shape: Mapping[str, int], layout: Any) -> list[int]:
    """The ranks whose plans differ: the first rank (coordinate 0 on every axis) of the first, a middle
    and the last pipeline stage; rank 0 alone without stages. ``layout``: the mesh's rank array
    (``DeviceMesh.mesh``, axes in ``mesh_shape``'s order)."""
    names = list(mesh_shape)
    if "pp" not in names or mesh_shape["pp"] <= 1:
        return [0]
    stages = mesh_shape["pp"]
    wanted = sorted({0, stages // 2, stages - 1})
    ranks = []
    axis = names.index("pp")
    for stage in wanted:
        index = [0] * len(names)
        index[axis] = stage
        ranks.append(int(layout[tuple(index)]))
    return ranks


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _layout(rank: int, accelerator: Accelerator, model: torch.nn.Module) -> RankLayout:
    mesh = accelerator.torch_device_mesh
    shape: dict[str, int] = {}
    coordinates: dict[str, int] = {}
    if mesh is not None:
        names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
        shape = dict(zip(names, (int(size) for size in mesh.mesh.shape), strict=True))
        coordinates = dict(zip(names, (int(c) for c in (mesh.get_coordinate() or [0] * mesh.ndim)), strict=True))
    local_bytes: dict[str, int] = {}
    local = total = 0
    for parameter in model.parameters():
        shard = _local(parameter)
        local += shard.numel()
        total += parameter.numel()
        dtype = str(shard.dtype).removeprefix("torch.")
        local_bytes[dtype] = local_bytes.get(dtype, 0) + shard.numel() * shard.element_size()
    state = accelerator.state
    return RankLayout(rank=rank, mesh=shape, coordinates=coordinates, strategy=str(accelerator.config["strategy"]),
                      mixed_precision=str(state.mixed_precision), local_parameters=local, total_parameters=total,
                      parameter_bytes=local_bytes)


def _describe(stage: str, exc: BaseException) -> str:
    text = str(exc).strip() or repr(exc)
    return f"{stage}: {type(exc).__name__}: {text}"


def plan_rank(inputs: PlanInputs, target: PlanTarget, rank: int,
              step: Callable[[Accelerator, torch.nn.Module, torch.optim.Optimizer, PlanInputs], Any] | None = None
              ) -> tuple[RankPlan, Any]:
    """Plan one rank in a fake world of the target's size: the Accelerator and ``prepare`` of the model
    built on the meta device (or what ``inputs.script`` prepares), and (``step``) the recorded fake
    step. Returns the plan and the rank's mesh rank array (for :func:`representative_ranks`), ``None``
    without a mesh."""
    started = time.perf_counter()
    if inputs.optimizer not in PLAN_OPTIMIZERS:
        raise PlanError(f"optimizer {inputs.optimizer!r} is not one the plan builds; choose one of "
                        f"{', '.join(sorted(PLAN_OPTIMIZERS))}")
    build = None if inputs.script is not None else resolve_model(inputs.model)
    stage = _Stage("Accelerator()")
    layout: RankLayout | None = None
    accelerator: Accelerator | None = None
    launched = world_environment(target.world_size, rank, target.processes_per_machine)
    with patch_environment(**launched, **inputs.environment), fake_world(
            target.world_size, rank, local_world_size=target.processes_per_machine):
        try:
            if build is not None:
                accelerator, model, optimizer = _prepare_model(build, inputs, stage)
            else:
                assert inputs.script is not None
                accelerator, model, optimizer = _prepare_script(inputs.script, inputs, stage)
            layout = _layout(rank, accelerator, accelerator.unwrap_model(model))
            recording = None
            if step is not None:
                stage.now = "the training step"
                recording = step(accelerator, model, optimizer, inputs)
        except PlanningUnsupported as exc:  # the layout, when it got that far, still stands
            return RankPlan(rank=rank, layout=layout, unsupported=str(exc),
                            seconds=time.perf_counter() - started), stage.layout_array
        except ScriptError as exc:
            return RankPlan(rank=rank, error=f"{exc.where}: {exc}", seconds=time.perf_counter() - started), \
                stage.layout_array
        except Exception as exc:  # noqa: BLE001 — the planned run's failure is the plan's finding
            return RankPlan(rank=rank, error=_describe(stage.now, exc),
                            seconds=time.perf_counter() - started), stage.layout_array
        finally:
            if accelerator is None and stage.accelerator is not None:
                accelerator = stage.accelerator
            if accelerator is not None:
                accelerator.end_training()
    return RankPlan(rank=rank, layout=layout, step=recording, seconds=time.perf_counter() - started), stage.layout_array


@attrs.define
class _Stage:
    """Where a rank's planning got to (its error names it), and what it holds so far."""

    now: str
    accelerator: Accelerator | None = None
    layout_array: Any = None

    def adopt(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator
        mesh = accelerator.torch_device_mesh
        self.layout_array = mesh.mesh.clone() if mesh is not None else None


def _prepare_model(build: tuple[str, Callable[[], torch.nn.Module]], inputs: PlanInputs,
                   stage: _Stage) -> tuple[Accelerator, torch.nn.Module, Any]:
    """MODEL built on the meta device and prepared with the plan's optimizer by an Accelerator of the
    resolved configuration."""
    name, factory = build
    accelerator = Accelerator(cpu=True)
    stage.adopt(accelerator)
    stage.now = "building the model"
    model = build_on_meta(factory, name)
    optimizer = PLAN_OPTIMIZERS[inputs.optimizer](model.parameters())
    stage.now = "accelerator.prepare(model, optimizer)"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's and transformers' warnings about meta tensors
        model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _prepare_script(script: ScriptTarget, inputs: PlanInputs, stage: _Stage) -> tuple[Accelerator, torch.nn.Module, Any]:
    """What the script prepares; the plan's optimizer, prepared by the script's Accelerator, when the
    script's first ``prepare`` of its model holds none."""
    stage.now = f"running {script.name} up to accelerator.prepare"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = run_until_prepared(script)
    stage.adopt(prepared.accelerator)
    optimizer = prepared.optimizer
    if optimizer is None:
        stage.now = f"preparing a {inputs.optimizer} optimizer for {script.name}'s model"
        optimizer = prepared.accelerator.prepare(PLAN_OPTIMIZERS[inputs.optimizer](prepared.model.parameters()))
    return prepared.accelerator, prepared.model, optimizer


def fake_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              inputs: PlanInputs) -> Iterator[str | None]:
    """One optimizer step of ``model`` (run it under ``FakeTensorMode``, the parameters given fake
    storage first), in phases: yields ``"forward"``, ``"backward"``, ``"optimizer"`` before each, so
    a recorder can attribute what follows. A pipelined model runs its schedule in the forward call,
    as a training loop calls it: ``model(inputs, target=labels)``; the schedule runs every
    micro-batch's backward (and the gradient reduce-scatters) inside that call, so ``None`` is
    yielded before it: the recorder tells forward from backward as they run, as on a real rank
    (``StepPhases``; labelled ``"forward"``, a stage's backward FLOPs and gradient collectives were
    counted as forward ones — tests/estimate/test_plan_calibration.py); with a ``cp`` axis, forward and
    backward run inside ``accelerator.maybe_context_parallel`` over the batch's sequence dimension."""
    pp = accelerator.device_submeshes.get("pp")
    if pp is not None and pp.size() > 1:  # the pipeline's input is token ids, whatever this rank's stage takes
        ids = torch.zeros(inputs.batch_size, inputs.seq_len, dtype=torch.long)
        made: tuple[tuple[Any, ...], dict[str, Any]] | str = (), {"input_ids": ids, "labels": ids}
    else:
        made = example_inputs(accelerator.unwrap_model(model), inputs.batch_size, inputs.seq_len)
    if isinstance(made, str):
        raise PlanError(made)
    args, kwargs = made
    sequence = [value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor) and value.dim() >= 2]
    # context parallel: what a CP loop does, the batch's sequence dimension sharded over cp around
    # forward and backward (a no-op without a cp axis)
    with accelerator.maybe_context_parallel(buffers=sequence, buffer_seq_dims=[1] * len(sequence)):
        if pp is not None and pp.size() > 1:
            yield None
            ids = kwargs.get("input_ids", args[0] if args else None)
            loss = model(ids, target=kwargs.get("labels", ids))
        else:
            yield "forward"
            loss = training_loss(model(*args, **kwargs))
        yield "backward"
        accelerator.backward(loss)
    yield "optimizer"
    optimizer.step()
    optimizer.zero_grad()


def _axes_across_nodes(axes: Mapping[str, str], processes_per_machine: int) -> dict[str, bool]:
    """Whether each recorded axis's group (this rank's) holds ranks of two machines, from its members."""
    placed = {"world": dist.get_world_size() > processes_per_machine}
    for group_name, label in axes.items():
        group = dist.distributed_c10d._resolve_process_group(group_name)
        machines = {rank // processes_per_machine for rank in dist.get_process_group_ranks(group)}
        placed[label] = len(machines) > 1
    return placed


def _follow_replaced_parameters(optimizers: Sequence[torch.optim.Optimizer], before: Mapping[str, Any],
                                after: Mapping[str, Any]) -> None:
    """``to_empty`` replaces plain parameters with new objects (DTensor ones are swapped in place):
    the optimizers' groups are pointed at the new ones, by name, so their state is created and counted."""
    replaced = {id(old): after[name] for name, old in before.items() if name in after and after[name] is not old}
    if not replaced:
        return
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [replaced.get(id(parameter), parameter) for parameter in group["params"]]


def _create_optimizer_state(model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """One unrecorded optimizer step on zero gradients, so the recorded step is a steady one: its
    optimizer state exists from the start (a first step creates it lazily, inside ``step()``, so its
    peak would lack the state every later step holds)."""
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    for parameter in trainable:
        parameter.grad = torch.zeros_like(parameter)
    for optimizer in optimizers:
        optimizer.step()
    for parameter in trainable:
        parameter.grad = None


def recorded_step(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  inputs: PlanInputs) -> StepRecording:
    """The planned rank's step under ``FakeTensorMode``, recorded: the prepared model's shards get fake
    storage, then :func:`fake_step` runs under the step recorder (collectives per axis, operator
    costs) and the memory tracker (:mod:`torchrig.estimate.recorder`, :mod:`torchrig.estimate.step_memory`)."""
    started = time.perf_counter()
    mesh = accelerator.torch_device_mesh
    axes = mesh_axes(mesh) if mesh is not None else {}
    for name, submesh in accelerator.device_submeshes.items():  # axes a strategy made outside the root mesh (ep)
        if submesh.ndim == 1:
            axes.setdefault(submesh.get_group().group_name, name)
    unwrapped = accelerator.unwrap_model(model)
    optimizers = [getattr(optimizer, "optimizer", optimizer)]
    with warnings.catch_warnings(), FakeTensorMode(allow_non_fake_inputs=True):
        warnings.simplefilter("ignore")  # backward-hook and view warnings of fake outputs
        before = dict(unwrapped.named_parameters())
        unwrapped.to_empty(device="cpu")
        _follow_replaced_parameters(optimizers, before, dict(unwrapped.named_parameters()))
        _create_optimizer_state(unwrapped, optimizers)
        memory = track_step_memory(unwrapped, optimizers)
        with memory, StepRecorder(axes) as recorder:
            for phase in fake_step(accelerator, model, optimizer, inputs):
                recorder.phase = phase
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return StepRecording(collectives=tuple(recorder.summary()), ops=tuple(recorder.op_costs()),
                         flops=recorder.flops_by_phase(), memory=memory.result,
                         axes_across_nodes=_axes_across_nodes(axes, local_world),
                         tokens=inputs.batch_size * inputs.seq_len, seconds=time.perf_counter() - started)


def plan_run(inputs: PlanInputs, target: PlanTarget,
             step: Callable[[Accelerator, torch.nn.Module, torch.optim.Optimizer, PlanInputs], Any] | None = None
             ) -> PlanReport:
    """Plan every representative rank (or ``inputs.ranks``)."""
    first, layout_array = plan_rank(inputs, target, inputs.ranks[0] if inputs.ranks else 0, step)
    plans = [first]
    if inputs.ranks:
        wanted = list(inputs.ranks[1:])
    elif first.layout is not None and layout_array is not None:
        wanted = [r for r in representative_ranks(first.layout.mesh, layout_array) if r != first.rank]
    else:
        wanted = []
    for rank in wanted:
        plans.append(plan_rank(inputs, target, rank, step)[0])
    return PlanReport(target=target, inputs=inputs, ranks=tuple(plans))


__all__ = ["PLAN_OPTIMIZERS", "PlanError", "PlanInputs", "ScriptTarget", "PlanReport", "PlanTarget", "RankLayout", "RankPlan",
           "StepRecording", "fake_step", "plan_rank", "plan_run", "recorded_step", "representative_ranks"]
