"""Expert parallelism (``parallelism_config.ep_size``): each rank of an ``ep`` group holds ``1/ep`` of every
mixture-of-experts layer's experts, and the tokens routed to an expert travel to its rank and back with
``all_to_all_single``.

Why this shape (torchtitan's, and transformers 5's ``ep_dispatch_experts``): ``ep`` is borrowed from
``dp_shard`` — the ranks of an ep group hold different batches, so the router runs on this rank's tokens as
before (its load-balancing loss unchanged), and the all-to-all moves only the (token, expert) pairs. The
``dp_shard`` axis is split into ``(efsdp, ep)``: the experts' weights are ``Shard(0)`` over ``ep`` and
FSDP2-sharded over ``efsdp`` (with ``dp_replicate`` in front for HSDP), the rest of the model over
``dp_shard`` as without EP. An expert's gradient adds the contributions of every rank of its ep group,
so the experts' local weights scale their gradient by ``1/ep`` in backward and FSDP2's mean over ``efsdp``
completes the mean over the whole data-parallel size, as every other parameter's gradient gets (FSDP2's own
``set_gradient_divide_factor`` needs NCCL's PREMUL_SUM with a sharded ``efsdp``, and divides nothing when
``efsdp`` has one rank).

Which modules hold experts: the model's own ``_ep_plan`` / ``base_model_ep_plan`` (transformers' names:
``ep_dispatch_experts`` for the experts module, ``grouped_gemm`` for its weights), or the user's
``parallelize_fn`` with :class:`ExpertParallel`. An experts module follows transformers' contract: a
``num_experts`` attribute, parameters whose leading dimension is the expert, and
``forward(hidden_states [tokens, dim], top_k_index [tokens, k], top_k_weights [tokens, k])`` returning each
token's weighted sum of its experts' outputs (docs/parallelism.md, "Expert parallel").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor, all_to_all_single_autograd
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle
from torchrig.plugin import ConfigError

from torchrig_fsdp.mesh import declared_plan, matches_by_segment

#: Attributes where a model declares its expert-parallel plan (transformers: on the config, ``base_model_``).
PLAN_ATTRIBUTES = ("_ep_plan", "base_model_ep_plan")
#: transformers' style names: the experts module, and its weights (placed by the module's entry here).
MODULE_STYLE, PARAMETER_STYLE = "ep_dispatch_experts", "grouped_gemm"
#: The names of the split ``dp_shard`` axis: experts' FSDP2 shards over ``efsdp``, tokens travel over ``ep``.
EXPERT_AXES = ("efsdp", "ep")


def expert_mesh(mesh: Any, ep_size: int) -> Any:
    """``mesh`` with its ``dp_shard`` axis unflattened into ``(efsdp, ep)`` (sizes ``dp_shard / ep``, ``ep``):
    the same ranks, the same root mesh (FSDP2 needs the experts' ``ep`` and ``efsdp`` meshes to share one).
    Collective: creates the two axes' process groups."""
    dp_shard = mesh["dp_shard"].size()
    return mesh._unflatten("dp_shard", (dp_shard // ep_size, ep_size), EXPERT_AXES)


def expert_submeshes(mesh: Any, ep_size: int) -> dict[str, Any]:
    """The named meshes of expert parallelism (none when ``ep_size`` is 1): ``ep`` (the tokens' all-to-all),
    ``efsdp`` (what the experts' FSDP2 shards over), and ``experts`` (the whole mesh with ``dp_shard`` split,
    :func:`experts_shard_mesh` slices HSDP's 2-D mesh from it). Collective: call on every rank."""
    if ep_size <= 1:
        return {}
    experts = expert_mesh(mesh, ep_size)
    return {"ep": experts["ep"], "efsdp": experts["efsdp"], "experts": experts}


def experts_shard_mesh(experts: Any) -> Any:
    """The mesh the experts' ``fully_shard`` shards over: ``efsdp``, with ``dp_replicate`` in front for HSDP."""
    names = tuple(experts.mesh_dim_names or ())
    return experts[("dp_replicate", "efsdp")] if "dp_replicate" in names else experts["efsdp"]


def model_ep_plan(model: torch.nn.Module) -> dict[str, str] | None:
    """The expert-parallel plan a model declares (``_ep_plan``, or ``base_model_ep_plan`` on its config),
    its patterns made relative to ``model`` as for tensor-parallel plans (:func:`torchrig_fsdp.mesh.declared_plan`)."""
    return declared_plan(model, PLAN_ATTRIBUTES)


def experts_modules(model: torch.nn.Module, plan: dict[str, str], where: str) -> list[str]:
    """The names of the modules ``plan`` marks ``ep_dispatch_experts``; ``grouped_gemm`` entries must name a
    parameter of one of them. Other styles, and a plan that marks no module, are errors naming ``where``."""
    modules = [name for name, _ in model.named_modules() if name]
    parameters = [name for name, _ in model.named_parameters()]
    found, problems = [], []
    for pattern, style in plan.items():
        if style == MODULE_STYLE:
            found += [name for name in modules if matches_by_segment(name, pattern)]
        elif style != PARAMETER_STYLE:
            problems.append(f"{where}: {pattern!r}: style {style!r} is not an expert-parallel style (use "
                            f"{MODULE_STYLE!r} for an experts module, {PARAMETER_STYLE!r} for its weights)")
    for pattern, style in plan.items():
        if style == PARAMETER_STYLE:
            stray = [name for name in parameters if matches_by_segment(name, pattern) and name.rpartition(".")[0] not in found]
            if stray:
                problems.append(f"{where}: {pattern!r} ({PARAMETER_STYLE}) names {stray[0]!r}, whose module is not "
                                f"marked {MODULE_STYLE!r}")
    if not found and not problems:
        problems.append(f"{where}: no {MODULE_STYLE!r} entry matches a module of {type(model).__name__}")
    if problems:
        raise ConfigError(problems)
    return found


def check_experts(module: torch.nn.Module, name: str, ep_size: int) -> list[str]:
    """What keeps ``module`` from being split over ``ep_size`` ranks (the experts contract, divisibility)."""
    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int):
        return [f"experts module {name!r} ({type(module).__name__}) has no integer num_experts attribute; an "
                "experts module declares how many experts its weights hold (docs/parallelism.md)"]
    if experts % ep_size:
        return [f"parallelism_config.ep_size: {ep_size} does not divide the {experts} experts of {name!r}; use an "
                f"ep_size that divides {experts}"]
    wrong = [attribute for attribute, param in module.named_parameters(recurse=False) if param.shape[:1] != (experts,)]
    if wrong or not list(module.parameters(recurse=False)):
        return [f"experts module {name!r}: parameters {wrong or 'none'} do not have the {experts} experts as their "
                "leading dimension; expert parallelism splits that dimension"]
    return []


class _ScaleGradient(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by ``factor``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


@contextlib.contextmanager
def local_expert_weights(module: torch.nn.Module, gradient_factor: float) -> Iterator[None]:
    """Run ``module``'s forward on the local shards of its DTensor weights (this rank's experts), their
    gradients scaled by ``gradient_factor``; the parameters restored afterwards."""
    originals = {name: param for name, param in module._parameters.items() if isinstance(param, DTensor)}
    try:
        for name, param in originals.items():
            module._parameters[name] = _ScaleGradient.apply(param.to_local(), gradient_factor)
        yield
    finally:
        module._parameters.update(originals)


class _Routing:
    """What one dispatch needs to bring the expert outputs back: the sort order of the (token, slot)
    pairs, the rows sent to and received from each ep rank, and the routing weights."""

    def __init__(self, order: torch.Tensor, send: list[int], receive: list[int], weights: torch.Tensor) -> None:
        self.order, self.send, self.receive, self.weights = order, send, receive, weights


def _exchange(rows: torch.Tensor, receive: list[int], send: list[int], group: Any) -> torch.Tensor:
    """``all_to_all_single`` of ``rows`` (``send[r]`` rows to rank ``r``), differentiable: the gradient goes
    back by the reverse exchange."""
    exchanged = all_to_all_single_autograd(rows.contiguous(), receive, send, group)
    return exchanged.wait() if isinstance(exchanged, AsyncCollectiveTensor) else exchanged


class ExpertParallel(ParallelStyle):
    """Places an experts module on the ``ep`` mesh: its weights ``Shard(0)`` (each rank its experts), its
    ``num_experts`` the local count, its forward wrapped in dispatch (sort the (token, expert) pairs by
    expert, exchange the counts, then the rows) and combine (the outputs back, in (token, slot) order,
    weighted by the router and summed). The experts run their own forward on local weights, top-1 with
    unit weights; transformers' experts get ``_is_expert_parallel``."""

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        ep_size, group = device_mesh.size(), device_mesh.get_group()
        global_experts = module.num_experts
        local_experts = global_experts // ep_size
        for attribute, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                # each rank keeps its chunk of its own copy, as fully_shard does (meta tensors too)
                module._parameters[attribute] = torch.nn.Parameter(
                    distribute_tensor(param.data, device_mesh, [Shard(0)], src_data_rank=None),
                    requires_grad=param.requires_grad)
        module.num_experts = local_experts
        module.expert_parallel_mesh = device_mesh  # what place_experts and fully_shard_experts look for
        if hasattr(module, "_is_expert_parallel"):
            module._is_expert_parallel = True
        forward = module.forward

        def run_experts(tokens: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
            with local_expert_weights(module, 1.0 / ep_size):
                if tokens.shape[0]:
                    return forward(tokens, expert_ids.unsqueeze(-1), tokens.new_ones((tokens.shape[0], 1)))
                # nothing came: one zero row keeps the weights and the exchange in backward (every rank joins)
                row = tokens.sum(dim=0, keepdim=True)
                return forward(row, expert_ids.new_zeros((1, 1)), row.new_ones((1, 1)))[:0]

        def expert_parallel_forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                    top_k_weights: torch.Tensor) -> torch.Tensor:
            hidden = hidden_states.to_local() if isinstance(hidden_states, DTensor) else hidden_states
            weights = top_k_weights.to_local() if isinstance(top_k_weights, DTensor) else top_k_weights
            received, expert_ids, routing = dispatch(hidden, top_k_index, weights, global_experts, ep_size, group)
            return combine(run_experts(received, expert_ids), routing, group).to(hidden.dtype)

        module.forward = expert_parallel_forward
        return module


def expert_counts(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, slot) pairs each expert got: ``bincount`` with a fixed output size (a scatter-add), so
    it also runs on fake tensors, where ``torch.bincount``'s data-dependent size cannot."""
    counts = expert_ids.new_zeros(num_experts)
    return counts.scatter_add_(0, expert_ids, torch.ones_like(expert_ids))


def balanced_split(rows: int, parts: int) -> list[int]:
    """``rows`` split into ``parts`` as evenly as integers allow (the first parts one larger)."""
    return [rows // parts + (1 if index < rows % parts else 0) for index in range(parts)]


def dispatch(hidden: torch.Tensor, top_k_index: torch.Tensor, weights: torch.Tensor, global_experts: int,
             ep_size: int, group: Any) -> tuple[torch.Tensor, torch.Tensor, _Routing]:
    """Send each (token, expert) pair to the rank holding the expert (experts are numbered rank by rank):
    returns the rows this rank's experts run on, their local expert ids, and the routing for :func:`combine`.
    One host sync per layer (the split sizes). Planned (``torchrig plan``: fake tensors, whose routing has
    no values), the router is taken to balance the pairs over the experts, the mean of a trained router
    with a load-balancing loss, so the all-to-alls carry the bytes of that case."""
    top_k, local_experts = top_k_index.shape[-1], global_experts // ep_size
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)  # grouped by expert, so by owning rank
    send_counts = expert_counts(expert_ids, global_experts).view(ep_size, local_experts)
    receive_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(receive_counts, send_counts, group=group)
    if isinstance(hidden, FakeTensor):
        send = receive = balanced_split(expert_ids.shape[0], ep_size)
        per_expert = [count for rank_rows in receive for count in balanced_split(rank_rows, local_experts)]
        receive_counts = torch.tensor(per_expert, device=hidden.device)
    else:
        send, receive = torch.stack([send_counts.sum(dim=1), receive_counts.sum(dim=1)]).tolist()
    received = _exchange(hidden[order // top_k], receive, send, group)
    local_ids = torch.arange(local_experts, device=hidden.device).repeat(ep_size)
    local_ids = local_ids.repeat_interleave(receive_counts.reshape(-1), output_size=received.shape[0])
    return received, local_ids, _Routing(order, send, receive, weights)


def combine(outputs: torch.Tensor, routing: _Routing, group: Any) -> torch.Tensor:
    """The expert outputs back to the ranks their tokens came from, in (token, slot) order, weighted by the
    router and summed over the slots."""
    returned = _exchange(outputs, routing.send, routing.receive, group)
    ordered = torch.empty_like(returned).index_copy(0, routing.order, returned)
    tokens, top_k = routing.weights.shape
    return (ordered.view(tokens, top_k, -1) * routing.weights.unsqueeze(-1)).sum(dim=1)


def apply_expert_parallel(model: torch.nn.Module, ep_mesh: Any, plan: dict[str, str] | None = None) -> list[str]:
    """:class:`ExpertParallel` on every experts module of ``plan`` (default: the model's own); returns their
    names. Errors name the plan, the module and what to do."""
    where = "the expert-parallel plan"
    if plan is None:
        plan, where = model_ep_plan(model), f"{type(model).__name__}'s own expert-parallel plan (_ep_plan)"
    if not plan:
        raise ConfigError([f"parallelism_config.ep_size: {ep_mesh.size()} but {type(model).__name__} declares no "
                           "expert-parallel plan (_ep_plan or its config's base_model_ep_plan, e.g. {'layers.*.mlp."
                           f"experts': '{MODULE_STYLE}'}}); declare one, or pass FullyShardedDataParallelPlugin("
                           "parallelize_fn=...) and apply torchrig_fsdp.expert_parallel.ExpertParallel yourself"])
    names = experts_modules(model, plan, where)
    problems = [problem for name in names for problem in check_experts(model.get_submodule(name), name, ep_mesh.size())]
    if problems:
        raise ConfigError(problems)
    style = ExpertParallel()
    for name in names:
        style._apply(model.get_submodule(name), ep_mesh)
    return names


def place_experts(model: torch.nn.Module, submeshes: dict[str, Any]) -> list[torch.nn.Module]:
    """With an ``ep`` mesh: the experts modules the user's ``parallelize_fn`` placed (an
    :class:`ExpertParallel` applied to them), else those of the model's own plan, placed here. Without
    one: none — and a module placed by ``parallelize_fn`` then is an error (no ep axis to shard over)."""
    placed = [module for module in model.modules() if getattr(module, "expert_parallel_mesh", None) is not None]
    ep = submeshes.get("ep")
    if ep is None:
        if placed:
            raise ConfigError(["parallelism_config.ep_size: an ExpertParallel style was applied but ep_size is 1; set "
                               "parallelism_config.ep_size (it divides dp_shard_size)"])
        return []
    if not placed:
        names = apply_expert_parallel(model, ep)
        placed = [model.get_submodule(name) for name in names]
    return placed


def fully_shard_experts(root: torch.nn.Module, experts: list[torch.nn.Module], shard_mesh: Any,
                        **fully_shard_arguments: Any) -> None:
    """``fully_shard`` each experts module inside ``root`` over ``shard_mesh`` (``efsdp``, HSDP: with
    ``dp_replicate``) before the blocks holding them are sharded over ``dp_shard``: the experts are
    ``Shard(0)`` on ``ep`` already, and FSDP2 adds the ``efsdp`` dimension (one root mesh for both)."""
    inside = {id(module) for module in root.modules()}
    for module in experts:
        if id(module) in inside:
            fully_shard(module, mesh=shard_mesh, **fully_shard_arguments)


__all__ = ["EXPERT_AXES", "MODULE_STYLE", "PARAMETER_STYLE", "PLAN_ATTRIBUTES", "ExpertParallel",
           "apply_expert_parallel", "balanced_split", "check_experts", "combine", "dispatch", "expert_mesh", "expert_submeshes",
           "expert_counts", "experts_modules", "experts_shard_mesh", "fully_shard_experts", "local_expert_weights", "model_ep_plan", "place_experts"]
