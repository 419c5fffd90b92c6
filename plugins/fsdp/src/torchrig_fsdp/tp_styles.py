"""torchrig's own tensor-parallel styles: ``ParallelStyle`` subclasses for what torch's
``torch.distributed.tensor.parallel`` has no class for.

Why: transformers' plans (:mod:`torchrig_fsdp.hf_styles`) name layouts torch does not ship — weights
packed along one dimension (``gate_up_proj`` = [gate; up]) that must be split per packed part,
replicated norms whose gradients only cover this rank's heads, mixture-of-experts blocks whose every
rank computes a slice of each expert. Each class here is a torch ``ParallelStyle`` (``_apply(module,
mesh)``), so ``parallelize_module`` applies it like torch's own, and the parameters it makes are
DTensors that FSDP2, ``full_tensor()``, DCP and torchrig's gradient clipping understand.

Local forwards: a module whose forward indexes or reshapes its weights (3-D expert weights, packed
projections) runs with its DTensor parameters swapped for their local shards (differentiable
``to_local``), and the style states the collectives around it explicitly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle
from torch.distributed.tensor.placement_types import _StridedShard

#: Builds a parameter's placement from the parameter (its number of dimensions decides the dim).
PlacementRule = Callable[[torch.nn.Parameter, str], Placement]


class _SumGradients(torch.autograd.Function):
    """Identity forward, gradient summed over the tensor-parallel group in backward: an input every
    rank holds whole but each rank's computation only differentiates for its own shard."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOutputs(torch.autograd.Function):
    """Outputs summed over the tensor-parallel group in forward (each rank computed a partial sum),
    gradient passed through unchanged (every rank's partial output fed the same sum)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        tensor = tensor.contiguous().clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    """This rank's slice of the last dimension in, the whole tensor out — a fresh tensor, never a
    view (``DTensor.to_local()`` returns a view, and FSDP2 warns that a module returning one can
    lose its pre-backward hook to an in-place op). Backward: this rank's slice of the gradient
    (every rank's gradient of the replicated output is the same)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: Any, sizes: list[int]) -> torch.Tensor:
        rank, widest = dist.get_rank(group), max(sizes)
        ctx.start, ctx.size = sum(sizes[:rank]), sizes[rank]
        padded = local.contiguous()
        if local.shape[-1] < widest:  # an uneven split: the all-gather wants equal pieces (no copy when even)
            padded = torch.nn.functional.pad(padded, (0, widest - local.shape[-1]))
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=group)
        if len(set(sizes)) == 1:
            return torch.cat(pieces, dim=-1)
        return torch.cat([piece[..., :size] for piece, size in zip(pieces, sizes)], dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad[..., ctx.start:ctx.start + ctx.size].contiguous(), None, None


def colwise_gather_output(*, input_layouts: Placement | None = None) -> ColwiseParallel:
    """torch's ``ColwiseParallel(output_layouts=Replicate())`` (transformers' ``colwise_gather_output``,
    ``colwise_rep``, ``embedding_colwise``) with one change: torch returns the gathered output through
    ``to_local()``, a view, which FSDP2 warns about when it is a wrapped module's output (a causal
    LM's logits: "returned a view tensor ... wrong gradients"); here the gather makes a fresh tensor.
    Still a ``ColwiseParallel`` (the plan checks read it as one): only its output function differs."""
    style = ColwiseParallel(input_layouts=input_layouts, output_layouts=Shard(-1), use_local_output=True)
    style._prepare_output_fn = _gather_output  # type: ignore[method-assign]  # read by ColwiseParallel._apply
    return style


def _gather_output(output_layouts: Any, use_local_output: bool, mod: torch.nn.Module, outputs: DTensor,
                   device_mesh: Any) -> torch.Tensor:
    """The column-wise output (sharded on its last dim) gathered whole on every rank, as a fresh tensor."""
    if outputs.placements != output_layouts:
        outputs = outputs.redistribute(placements=output_layouts)
    ranks = device_mesh.size()
    sizes = [len(part) for part in torch.arange(outputs.shape[-1]).chunk(ranks)]  # DTensor's (uneven) split
    sizes += [0] * (ranks - len(sizes))
    return _GatherLastDim.apply(outputs.to_local(), device_mesh.get_group(), sizes)


def sum_gradients(tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
    return _SumGradients.apply(tensor, mesh.get_group())


def sum_outputs(tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
    return _SumOutputs.apply(tensor, mesh.get_group())


def _local(tensor: Any) -> Any:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@contextlib.contextmanager
def local_parameters(module: torch.nn.Module, grad_placements: Any = None) -> Iterator[None]:
    """Run ``module``'s forward with each DTensor parameter replaced by its local shard (a
    differentiable ``to_local``: gradients reach the DTensor parameter with ``grad_placements``, or
    its own placements), the parameters restored afterwards."""
    originals = {name: param for name, param in module._parameters.items() if isinstance(param, DTensor)}
    try:
        for name, param in originals.items():
            module._parameters[name] = param.to_local(grad_placements=grad_placements)
        yield
    finally:
        module._parameters.update(originals)


def _wrap_forward(module: torch.nn.Module, before: Callable[[tuple], tuple] | None,
                  around: Callable[[], Any] | None, after: Callable[[Any], Any] | None) -> None:
    """Replace ``module.forward`` by ``after(forward(*before(args)))`` run inside ``around()``."""
    forward = module.forward

    def tensor_parallel_forward(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            args = before(args)
        with around() if around is not None else contextlib.nullcontext():
            output = forward(*args, **kwargs)
        return after(output) if after is not None else output

    module.forward = tensor_parallel_forward


def packed_rows(param: torch.nn.Parameter, name: str) -> Placement:
    """Packed along the output features ([gate; up] rows; dim 1 of a 3-D expert weight): each rank
    holds its slice of every packed part, so ``chunk(2)`` of a local output is (gate, up)."""
    return _StridedShard(max(param.ndim - 2, 0), split_factor=2)


def packed_columns(param: torch.nn.Parameter, name: str) -> Placement:
    """Packed along the input features (last dim): a 1-D parameter (a bias) stays whole."""
    return Replicate() if param.ndim == 1 else _StridedShard(param.ndim - 1, split_factor=2)


def output_rows(param: torch.nn.Parameter, name: str) -> Placement:
    """Column-wise parallel's weight: output features (dim -2, the rows of a Linear weight)."""
    return Shard(max(param.ndim - 2, 0))


def input_columns(param: torch.nn.Parameter, name: str) -> Placement:
    """Row-wise parallel's weight: input features (last dim); a bias stays whole (added once, after the sum)."""
    return Replicate() if name == "bias" or param.ndim == 1 else Shard(param.ndim - 1)


def _distribute(module: torch.nn.Module, mesh: Any, rules: dict[str, PlacementRule]) -> None:
    for name, rule in rules.items():
        param = module._parameters.get(name)
        if param is None or isinstance(param, DTensor):
            continue
        placement = rule(param, name)
        module._parameters[name] = torch.nn.Parameter(distribute_tensor(param.data, mesh, [placement]),
                                                      requires_grad=param.requires_grad)


class KeepWhole(ParallelStyle):
    """transformers' ``replicate``: every rank keeps the whole module (nothing to shard, no hook)."""

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        return module


class ReplicatedSumGradients(ParallelStyle):
    """transformers' ``replicated_with_grad_allreduce``: a replicated module (Qwen3's per-head
    ``q_norm``/``k_norm``) that sits between a column-wise and a row-wise projection and so sees only
    this rank's heads — the forward needs no collective, but each rank's parameter gradient covers
    its heads only, so the gradients are summed over ``tp`` (parameters: Replicate DTensors whose
    gradient is Partial; FSDP2, the optimizer and clipping reduce it)."""

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        for name, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                module._parameters[name] = torch.nn.Parameter(
                    distribute_tensor(param.data, device_mesh, [Replicate()]), requires_grad=param.requires_grad)
        _wrap_forward(module, None, lambda: local_parameters(module, [Partial()]), None)
        return module


class LocalParameters(ParallelStyle):
    """transformers' ``local_params``: the module's forward sees its own sharded parameters as
    local tensors (a bare ``nn.Parameter`` such as attention sinks, sharded by its own plan entry)."""

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        _wrap_forward(module, None, lambda: local_parameters(module), None)
        return module


class PackedColwiseParallel(ParallelStyle):
    """transformers' ``packed_colwise`` on a module (a fused ``gate_up_proj``/``qkv`` Linear): the
    weight split per packed part (each rank: its slice of gate and its slice of up), the input
    replicated (its gradient summed over ``tp``), the local output this rank's slice of each part."""

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        _distribute(module, device_mesh, {"weight": packed_rows, "bias": packed_rows})

        def before(args: tuple) -> tuple:
            return (sum_gradients(_local(args[0]), device_mesh), *args[1:])

        _wrap_forward(module, before, lambda: local_parameters(module), None)
        return module


class ExpertsTensorParallel(ParallelStyle):
    """transformers' ``moe_tp_experts``: every rank computes every expert on its slice of the
    intermediate features (``gate_up_proj`` packed rows, ``down_proj`` input columns: their own plan
    entries) — the hidden states and routing weights enter whole (their gradients summed over
    ``tp``), the partial outputs are summed over ``tp``. Routing itself (the router, top-k) runs
    replicated and identically on every rank, so no token moves between ranks."""

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        def before(args: tuple) -> tuple:
            hidden, *routing = args
            hidden = sum_gradients(_local(hidden), device_mesh)
            if len(routing) >= 2:  # (top_k_index, top_k_weights, ...)
                routing[1] = sum_gradients(_local(routing[1]), device_mesh)
            return (hidden, *routing)

        def after(output: Any) -> Any:
            return None if output is None else sum_outputs(output, device_mesh)

        _wrap_forward(module, before, lambda: local_parameters(module), after)
        return module


class IdentityExpert(ParallelStyle):
    """transformers' ``moe_identity_expert``: an identity "expert" inside a ``moe_tp_experts`` block
    returns its input on every rank, which the block then sums over ``tp`` — so its input is divided
    by the ``tp`` size first."""

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        _wrap_forward(module, lambda args: (args[0] / device_mesh.size(), *args[1:]), None, None)
        return module


class ShardedParameters(ParallelStyle):
    """Plan entries that name *parameters* (transformers' expert weights ``experts.gate_up_proj``):
    the parameters of one module distributed by their rules, then the module's own style (which
    must run its forward on local shards: :data:`LOCAL_FORWARD_STYLES`)."""

    def __init__(self, rules: dict[str, PlacementRule], then: ParallelStyle | None):
        self.rules, self.then = rules, then

    def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
        _distribute(module, device_mesh, self.rules)
        return self.then._apply(module, device_mesh) if self.then is not None else module


#: Module styles whose forward runs on local shards, so parameters sharded by a parameter entry work.
LOCAL_FORWARD_STYLES = (ExpertsTensorParallel, LocalParameters, PackedColwiseParallel)

__all__ = ["LOCAL_FORWARD_STYLES", "ExpertsTensorParallel", "IdentityExpert", "KeepWhole", "LocalParameters",
           "PackedColwiseParallel", "PlacementRule", "ReplicatedSumGradients", "ShardedParameters", "colwise_gather_output",
           "input_columns",
           "local_parameters", "output_rows", "packed_columns", "packed_rows", "sum_gradients", "sum_outputs"]
