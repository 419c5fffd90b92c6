"""Pipeline parallelism of the ``fsdp`` strategy on ``torch.distributed.pipelining`` (the ``pp`` mesh axis).

Each ``pp`` rank keeps one stage: the user's model with the other stages' modules removed, **names
kept** (torchtitan's way), so state dicts and DCP checkpoints use the unsplit model's keys and a
checkpoint saved under ``pp_size`` 2 loads into the whole model. Tensor parallel and ``fully_shard``
then apply to the stage as to a whole model (over the stage's ``tp`` and ``dp_shard`` sub-meshes).

The loop stays Accelerate's: ``loss = model(inputs, target=labels)`` runs the schedule (forward and
backward of every micro-batch, the loss computed on the last stage by ``pp_loss_fn``), and returns the
batch's loss on every rank (by default its cross-entropy over valid tokens, divided by their number:
:class:`TokenMeanLoss`; a user's ``pp_loss_fn``: the mean over micro-batches). The schedule's gradients are held back and ``accelerator.backward(loss)``
adds them, multiplied by whatever the loss was multiplied by on the way (``1 / gradient_accumulation_steps``,
a loss scale): the step plan's backward is unchanged and nothing runs backward twice. docs/parallelism.md.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torchrig.plugin import ConfigError

from torchrig_fsdp import pp_plan, pp_planning

SPLIT_KEY = "parallelism_config.pp_split_points"
INTERLEAVED = "Interleaved1F1B"
#: Containers whose children are split units (a stage may take some layers of a list).
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


#: The label of a position that is no prediction target (padding, prompt): torch's and transformers'.
IGNORE_INDEX = -100


class TokenMeanLoss:
    """The default ``pp_loss_fn``: a micro-batch's cross-entropy over the last dimension (logits of a
    language model, in fp32) *summed* over its valid tokens (label != -100), divided by the valid tokens
    of the whole batch the schedule step runs — so the micro-batches' losses add up to the batch's
    token mean, and a token weighs the same in a short micro-batch as in a long one (the mean of
    micro-batch means does not). Its schedule adds the micro-batches' gradients (``scale_grads=False``)."""

    def __init__(self) -> None:
        #: The valid tokens of the batch being run (:meth:`count_batch`), at least 1; None: not yet counted.
        self.batch_tokens: torch.Tensor | None = None

    def count_batch(self, target: torch.Tensor) -> None:
        """Count ``target``'s valid tokens before the schedule splits it (every rank is given the target).
        A batch of padding only counts 1: its loss and gradients are zero, not NaN."""
        self.batch_tokens = target.ne(IGNORE_INDEX).sum().clamp(min=1)

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        total = torch.nn.functional.cross_entropy(output.flatten(0, -2).float(), target.flatten(),
                                                  ignore_index=IGNORE_INDEX, reduction="sum")
        return total if self.batch_tokens is None else total / self.batch_tokens.to(total.device)


# -- splitting ------------------------------------------------------------------------------------


def split_units(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str]]:
    """The modules a split point may name, in registration order (``(name, parent, key)``): the
    model's children, a container child (``ModuleList``, ``ModuleDict``, ``Sequential``) replaced by
    its own children, so that ``layers.2`` is a unit."""
    if isinstance(model, _CONTAINERS):  # a Sequential model: its children
        return [(key, model, key) for key, child in model._modules.items() if child is not None]
    units = []
    for key, child in model._modules.items():
        if child is None:
            continue
        if isinstance(child, _CONTAINERS):
            units += [(f"{key}.{inner}", child, inner) for inner, grand in child._modules.items() if grand is not None]
        else:
            units.append((key, model, key))
    return units


def stage_of_units(model: torch.nn.Module, split_points: list[str]) -> dict[str, int]:
    """For each unit of :func:`split_units` (by name), the stage it belongs to. Errors name the key
    and list the units when a point names no unit, points are out of order, or a stage would be empty."""
    units = [name for name, _, _ in split_units(model)]
    index = {name: i for i, name in enumerate(units)}
    listing = ", ".join(units[:24]) + (", ..." if len(units) > 24 else "")
    missing = [point for point in split_points if point not in index]
    if missing:
        raise ConfigError([f"{SPLIT_KEY}: {', '.join(repr(p) for p in missing)} names no module {type(model).__name__} "
                           f"can be split at; split points (in order): {listing}"])
    starts = [index[point] for point in split_points]
    if starts != sorted(starts) or starts[0] == 0:
        raise ConfigError([f"{SPLIT_KEY}: {split_points!r} must name modules in the model's order, after its first "
                           f"one ({units[0]}), so that no stage is empty; split points (in order): {listing}"])
    return {name: sum(1 for start in starts if position >= start) for position, name in enumerate(units)}


def keep_stages(model: torch.nn.Module, owner: dict[str, int], stages: set[int]) -> torch.nn.Module:
    """Remove from ``model``, in place, the modules of the stages not in ``stages`` (``owner``: unit
    name -> stage): an entry of a container is deleted (the others keep their names), a child of the
    model is set to ``None`` (the model's forward must skip a ``None`` module, as torchtitan's
    models do). Returns ``model``."""
    direct = [name for name, _ in model.named_parameters(recurse=False)]
    if direct:
        raise ConfigError([f"{SPLIT_KEY}: {type(model).__name__} has parameters on the model itself "
                           f"({', '.join(direct)}), which no stage owns; move them into a submodule or split with "
                           "pp_split_fn (Python)"])
    for name, parent, key in split_units(model):
        if owner[name] in stages:
            continue
        if isinstance(parent, _CONTAINERS):
            del parent._modules[key]
        else:
            setattr(parent, key, None)
    return model


def _clone(module: torch.nn.Module) -> torch.nn.Module:
    """A module object of its own (children, parameters, hooks in dicts of its own) sharing every
    submodule and tensor with ``module``."""
    clone = copy.copy(module)
    for key, value in vars(clone).items():
        if isinstance(value, (dict, set)):
            clone.__dict__[key] = copy.copy(value)
    return clone


def stage_view(model: torch.nn.Module, owner: dict[str, int], stage: int) -> torch.nn.Module:
    """One stage of a rank holding several (interleaved schedules): a clone of ``model`` (and of
    its containers) without the other stages' units, sharing their modules and parameters with
    ``model`` — so ``model`` keeps the rank's state dict under the original names."""
    root = _clone(model)
    containers: dict[int, torch.nn.Module] = {}
    for name, parent, key in split_units(model):
        if owner[name] == stage:
            continue
        if parent is model:
            target = root
        else:
            if id(parent) not in containers:
                container_key = name.split(".")[0]
                containers[id(parent)] = root._modules[container_key] = _clone(parent)
            target = containers[id(parent)]
        if isinstance(target, _CONTAINERS):
            del target._modules[key]
        else:
            target._modules[key] = None
    return root


def _no_split(num_stages: int, what: str) -> str:
    return (f"{SPLIT_KEY}: pp_size is {num_stages} but nothing says where to split {what} into stages (and it "
            f"declares no base_model_pp_plan, as transformers models do); set {SPLIT_KEY} (e.g. [layers.2]: the "
            "module each later stage begins with) or pass ParallelismConfig(pp_split_fn=...)")


def check(config: Any, options: Any) -> None:
    """Refused when the run starts: options a pipeline cannot honour. ``config``: the
    ``ParallelismConfig``, ``options``: the ``fsdp_config``. A missing split is judged at ``prepare``,
    where the model is known (its own ``base_model_pp_plan`` may split it, :mod:`torchrig_fsdp.pp_plan`)."""
    problems = []
    if options.cpu_ram_efficient_loading:
        problems.append("fsdp_config.cpu_ram_efficient_loading: not supported with pipeline parallelism "
                        "(parallelism_config.pp_size > 1): each stage holds other weights than rank 0's")
    if config.loss_parallel:
        problems.append("parallelism_config.loss_parallel: not supported with pipeline parallelism (pp_size > 1): "
                        "the schedule computes the loss with pp_loss_fn on the last stage")
    if problems:
        raise ConfigError(problems)


def build_stage(model: torch.nn.Module, stage: int, num_stages: int, split_points: list[str] | None,
                split_fn: Any) -> torch.nn.Module:
    """The stage module of ``stage``: ``pp_split_fn(model, stage, num_stages)`` when given, else the
    model cut at ``pp_split_points``; neither is refused naming both keys."""
    if split_fn is not None:
        module = split_fn(model, stage, num_stages)
        if not isinstance(module, torch.nn.Module):
            raise ConfigError([f"parallelism_config.pp_split_fn: returned {type(module).__name__} for stage {stage}; "
                               "it must return the stage's torch.nn.Module"])
        return module
    if not split_points:
        raise ConfigError([_no_split(num_stages, type(model).__name__)])
    if len(split_points) + 1 != num_stages:
        raise ConfigError([f"{SPLIT_KEY}: {len(split_points)} split point(s) make {len(split_points) + 1} stages but "
                           f"pp_size is {num_stages}"])
    return keep_stages(model, stage_of_units(model, list(split_points)), {stage})


def build_rank(model: torch.nn.Module, pp_rank: int, pp_size: int, schedule: str, split_points: list[str] | None,
               split_fn: Any) -> tuple[torch.nn.Module, list[tuple[int, torch.nn.Module]], int]:
    """This ``pp`` rank's part of the model: (the module holding its stages, under the original
    names; ``[(stage index, stage module)]``; the number of stages). One stage per rank, except
    with ``Interleaved1F1B``: stages ``pp_rank``, ``pp_rank + pp_size``, ... (torch's loop order).
    Neither split points nor a split function: the model's own pipeline plan, if it declares one."""
    if split_fn is None and not split_points:
        if schedule == INTERLEAVED and pp_plan.find_plan(model) is not None:
            raise ConfigError([f"{SPLIT_KEY}: pp_schedule {INTERLEAVED} puts several stages on each rank, but the "
                               f"split from {type(model).__name__}'s base_model_pp_plan makes one per rank; use 1F1B "
                               "or GPipe, or give the stages as split points"])
        derived = pp_plan.split_by_plan(model, pp_rank, pp_size)
        if derived is not None:
            module, stage = derived
            return module, [(pp_rank, stage)], pp_size
    if schedule != INTERLEAVED:
        module = build_stage(model, pp_rank, pp_size, split_points, split_fn)
        return module, [(pp_rank, module)], pp_size
    if split_fn is not None or not split_points:
        raise ConfigError([f"{SPLIT_KEY}: pp_schedule {INTERLEAVED} puts several stages on each rank; give them as "
                           "split points (pp_split_fn makes one stage per rank)"])
    num_stages = len(split_points) + 1
    if num_stages % pp_size or num_stages < 2 * pp_size:
        raise ConfigError([f"{SPLIT_KEY}: {len(split_points)} split point(s) make {num_stages} stages; {INTERLEAVED} "
                           f"needs a multiple of pp_size ({pp_size}), at least {2 * pp_size} (two stages per rank)"])
    owner = stage_of_units(model, list(split_points))
    local = list(range(pp_rank, num_stages, pp_size))
    keep_stages(model, owner, set(local))
    return model, [(stage, stage_view(model, owner, stage)) for stage in local], num_stages


def prune_optimizer(optimizer: torch.optim.Optimizer, stage: torch.nn.Module) -> None:
    """Drop from ``optimizer`` the parameters of the other stages (an optimizer built over the
    whole model before ``prepare``); refuses one that holds none of this stage's parameters."""
    kept = {id(p) for p in stage.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if held and kept and not any(id(p) in kept for p in held):
        raise ConfigError(["parallelism_config.pp_split_fn: the stage module's parameters are not the model's (the "
                           "optimizer holds none of them, so it would train nothing); build the stage from the "
                           "model's own submodules"])
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in kept]
    for param in [p for p in optimizer.state if id(p) not in kept]:
        del optimizer.state[param]


# -- the schedule ---------------------------------------------------------------------------------


def make_schedule(name: str, stages: list[Any], microbatches: int, loss_fn: Any, *, planned: bool = False) -> Any:
    """torch's schedule ``name`` over ``stages``; ``planned``: its planning variant
    (:func:`torchrig_fsdp.pp_planning.planned_class`: no warm-up vote, stages in static mode)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    schedules = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, INTERLEAVED: ScheduleInterleaved1F1B}
    schedule_class = pp_planning.planned_class(schedules[name]) if planned else schedules[name]
    # a user's pp_loss_fn is a micro-batch mean: the schedule averages over micro-batches; the default's
    # losses are already shares of the batch's token mean, so their gradients add up
    scale_grads = not isinstance(loss_fn, TokenMeanLoss)
    if name == INTERLEAVED:
        return schedule_class(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return schedule_class(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)


def boundary_probe(model: torch.nn.Module, num_stages: int, split_points: list[str] | None,
                   split_fn: Any) -> pp_planning.BoundaryProbe:
    """For a planned run, taken before the split: what finds the tensors passed between stages
    (:mod:`torchrig_fsdp.pp_planning`) — a user split keeps a copy of the unsplit meta model to
    rebuild and chain the earlier stages on."""
    if split_fn is None and not split_points:  # the model's own plan: the hidden states
        return pp_planning.BoundaryProbe(num_stages, None, None)

    def build(copy_of_model: torch.nn.Module, stage: int) -> torch.nn.Module:
        if split_fn is not None:
            return split_fn(copy_of_model, stage, num_stages)
        return keep_stages(copy_of_model, stage_of_units(copy_of_model, list(split_points or [])), {stage})

    return pp_planning.BoundaryProbe(num_stages, copy.deepcopy(model), build)


class _HeldGradients(torch.autograd.Function):
    """The loss a schedule step returns: its backward adds the gradients the schedule computed,
    times the gradient it receives (1, or 1/accumulation steps, or a loss scale)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, anchor: torch.Tensor, held: list[tuple[Any, Any]],
                planned: bool) -> torch.Tensor:
        ctx.held = held
        ctx.planned = planned
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        # a planned (fake) gradient has no value to read: the gradients are scaled by it as a tensor
        factor = grad if ctx.planned else float(grad)
        with torch.no_grad():
            for param, computed in ctx.held:
                if ctx.planned or factor != 1.0:
                    computed.mul_(factor)
                if param.grad is None:
                    param.grad = computed
                else:
                    param.grad.add_(computed)
        ctx.held = []
        return None, None, None, None


class PipelineParallel(torch.nn.Module):
    """This rank's pipeline stage and its schedule. ``model(*inputs, target=labels)`` runs the
    schedule on the batch (forward and backward when gradients are enabled, forward only under
    ``torch.no_grad``) and returns the batch's loss (the default loss: its token mean; a user's
    ``pp_loss_fn``: the mean of the micro-batches'), the same on every rank of the pipeline.
    ``module`` is the stage (the user's model minus the other stages, names kept)."""

    def __init__(self, module: torch.nn.Module, schedule: Any, stages: list[Any], group: Any, microbatches: int,
                 planning: tuple[pp_planning.BoundaryProbe, str, Any] | None = None,
                 token_loss: TokenMeanLoss | None = None) -> None:
        super().__init__()
        #: The default loss, told each batch's valid-token count before the schedule runs; None: the user's.
        self._token_loss = token_loss
        self.module = module
        self._pipeline = (schedule, stages, group)
        self.microbatches = microbatches
        #: A planned run: (boundary probe, schedule name, loss function) to build its static schedule.
        self._planning = planning
        self._planned: dict[tuple[int, ...], tuple[Any, list[Any]]] = {}

    @property
    def schedule(self) -> Any:
        """The ``torch.distributed.pipelining`` schedule this rank runs (``pp_schedule``)."""
        return self._pipeline[0]

    def train(self, mode: bool = True) -> PipelineParallel:
        """Also the stage views of an interleaved rank (clones of ``module``'s root, not its children)."""
        super().train(mode)
        for stage in self._pipeline[1]:
            stage.submod.train(mode)
        return self

    def _planned_schedule(self, batch: torch.Tensor) -> tuple[Any, list[Any]]:
        """A planned run's schedule and stages for this batch shape: torch's, in static mode
        (:mod:`torchrig_fsdp.pp_planning`), the boundaries found for one micro-batch of ``batch``
        (the first stage's input; every rank of a loop is given it)."""
        assert self._planning is not None
        probe, name, loss_fn = self._planning
        micro = torch.empty((batch.shape[0] // self.microbatches, *batch.shape[1:]), dtype=batch.dtype,
                            device="meta")
        key = tuple(micro.shape)
        if key not in self._planned:
            _, real_stages, group = self._pipeline
            own = [(stage.stage_index, stage.submod) for stage in real_stages]
            stages = pp_planning.planned_stages(own, probe.boundaries(micro, own), real_stages[0].num_stages,
                                                real_stages[0].device, group)
            self._planned[key] = (make_schedule(name, stages, self.microbatches, loss_fn, planned=True), stages)
        return self._planned[key]

    def forward(self, *args: Any, target: Any = None, **kwargs: Any) -> torch.Tensor:
        schedule, stages, group = self._pipeline
        first, last = any(stage.is_first for stage in stages), any(stage.is_last for stage in stages)
        if target is None:
            raise ValueError("a pipeline-parallel model computes the loss inside its schedule (parallelism_config."
                             "pp_size > 1): call model(inputs, target=labels); the loss function is "
                             "parallelism_config.pp_loss_fn (default: cross-entropy)")
        batch = target.shape[0] if torch.is_tensor(target) else None
        if batch is not None and batch % self.microbatches:
            raise ValueError(f"parallelism_config.pp_microbatches: the batch of {batch} samples does not split into "
                             f"{self.microbatches} micro-batches; make the batch size a multiple of it")
        if self._planning is not None:
            given = next((value for value in (*args, target) if torch.is_tensor(value)), None)
            if given is None:
                raise ValueError("a planned pipeline step needs the batch's token ids (or target) as a tensor")
            schedule, stages = self._planned_schedule(given)
        token_loss = self._token_loss
        if token_loss is not None and torch.is_tensor(target) and target.device.type != "meta":
            token_loss.count_batch(target)
        inputs = args if first else ()
        extra = kwargs if first else {}
        losses: list[torch.Tensor] = []
        training = torch.is_grad_enabled()
        held: list[tuple[Any, Any]] = []
        if training:
            params = [p for p in self.module.parameters() if p.requires_grad]
            before = [p.grad for p in params]
            for param in params:
                param.grad = None
            def run_step() -> None:
                schedule.step(*inputs, target=target if last else None, losses=losses,
                              return_outputs=False, **extra)

            try:
                if self._planning is not None:
                    pp_planning.run_planned(run_step)
                else:
                    run_step()
            finally:
                computed = [p.grad for p in params]
                for param, grad in zip(params, before, strict=True):
                    param.grad = grad
            held = [(p, g) for p, g in zip(params, computed, strict=True) if g is not None]
        else:
            schedule.eval(*inputs, target=target if last else None, losses=losses, **extra)
        loss = self._broadcast_loss(losses, group, last, stages[0].device, summed=token_loss is not None)
        if not training:
            return loss
        anchor = torch.zeros((), device=loss.device, requires_grad=True)
        return _HeldGradients.apply(loss, anchor, held, self._planning is not None)

    def _broadcast_loss(self, losses: list[torch.Tensor], group: Any, last: bool, device: Any,
                        summed: bool) -> torch.Tensor:
        """From the rank holding the last stage (the last ``pp`` rank, in every schedule here): the
        micro-batches' losses added (``summed``: the default loss, shares of the batch's token mean),
        else their mean."""
        if last:
            stacked = torch.stack([value.detach().float() for value in losses])
            loss = (stacked.sum() if summed else stacked.mean()).to(device)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=device)
        dist.broadcast(loss, group=group, group_src=dist.get_world_size(group) - 1)
        return loss


def wrap(device: torch.device, module: torch.nn.Module, stages: list[tuple[int, torch.nn.Module]], num_stages: int,
         mesh: Any, schedule_name: str, microbatches: int, loss_fn: Any,
         probe: pp_planning.BoundaryProbe | None = None) -> PipelineParallel:
    """This rank's stages as ``PipelineStage`` objects over the ``pp`` sub-mesh's group, their
    schedule, and the module the loop calls (``module``: the rank's part of the model). ``probe``
    (:func:`boundary_probe`): the run is planned, its step runs the planning schedule."""
    from torch.distributed.pipelining import PipelineStage

    group = mesh["pp"].get_group()
    pipeline_stages = [PipelineStage(stage, index, num_stages, device, group=group) for index, stage in stages]
    loss_fn = loss_fn or TokenMeanLoss()
    schedule = make_schedule(schedule_name, pipeline_stages, microbatches, loss_fn)
    planning = (probe, schedule_name, loss_fn) if probe is not None else None
    return PipelineParallel(module, schedule, pipeline_stages, group, microbatches, planning,
                            token_loss=loss_fn if isinstance(loss_fn, TokenMeanLoss) else None)


def join_stages(state: dict[str, Any], group: Any, *, rank0_only: bool) -> dict[str, Any]:
    """The whole model's state dict from each stage's (full, on the CPU; names are the unsplit
    model's, so joining is a union): on the main process (others get ``{}``), or on every rank."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    if rank0_only:
        first = dist.get_rank(group) == 0
        dist.gather_object(state, parts if first else None, group=group, group_dst=0)
        if not first or dist.get_rank() != 0:
            return {}
    else:
        dist.all_gather_object(parts, state, group=group)
    return {key: value for part in parts for key, value in part.items()}


def group_device(group: Any) -> torch.device:
    """Where a collective over ``group`` takes its tensors (gloo: the CPU; nccl: this rank's GPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def pp_group(mesh: Any) -> Any:
    return mesh["pp"].get_group() if mesh is not None and "pp" in (mesh.mesh_dim_names or ()) else None


__all__ = ["IGNORE_INDEX", "INTERLEAVED", "PipelineParallel", "TokenMeanLoss", "boundary_probe", "build_rank", "build_stage", "check", "group_device",
           "join_stages", "keep_stages", "make_schedule", "pp_group", "prune_optimizer", "split_units", "stage_of_units",
           "stage_view", "wrap"]
