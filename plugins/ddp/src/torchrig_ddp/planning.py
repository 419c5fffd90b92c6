"""DDP's stand-in for ``torchrig plan``: the collectives of DDP's reducer, without the reducer.

Why: a planned run's model lives on the meta device and later gets fake storage
(``FakeTensorMode``); ``DistributedDataParallel``'s C++ reducer reads real storage at construction
and on the fake process group (its Work carries no value), so it cannot be built there. The stand-in
issues, from Python, exactly what the reducer issues in a steady step of the real run (torch 2.13,
torch/nn/parallel/distributed.py and c10d's reducer):

* gradient buckets as DDP computes them: ``_BucketCapacityConfig`` turns ``bucket_cap_mb`` into the
  byte caps (the first bucket is 1 MiB only when ``bucket_cap_mb`` is left to DDP's default) and
  ``torch.distributed._compute_bucket_assignment_by_size`` assigns the parameters — in the order
  their gradients became ready in the first synchronised backward (DDP's bucket rebuild; every
  step after the first uses those buckets), or, with ``find_unused_parameters``, once at
  construction over the parameters in reverse definition order (DDP does not rebuild then);
* one ``dist.all_reduce`` of each bucket's flat gradient on the DDP process group, in bucket order,
  when the bucket's last gradient is ready (post-accumulate-grad hooks) — compressed to fp16/bf16
  first under those comm hooks (half the bytes), none after a forward under ``no_sync()``;
* with ``find_unused_parameters``, after the last bucket, the all-reduce of the map of used
  parameters (one int32 each);
* with ``broadcast_buffers``, the broadcast of the module's buffers from rank 0 before each forward
  that follows a synchronised one (``_broadcast_coalesced``: one broadcast per 250 MiB bucket).

What differs from a real DDP, on purpose: nothing is moved, broadcast or checked at construction,
and its first step reduces the rebuilt buckets (a real DDP's first step reduces one bucket of
everything: it cannot know the order yet).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel.distributed import _BucketCapacityConfig
from torchrig.plugin import PlanningUnsupported

#: DDP's ``broadcast_bucket_size``: the buffers' broadcast is coalesced into buckets of this size.
BROADCAST_BUCKET_BYTES = 250 * 1024 * 1024


class PlannedDistributedDataParallel(torch.nn.Module):
    """Behaves like ``DistributedDataParallel`` for what the core and a training loop touch
    (``.module``, ``no_sync()``, forward, ``require_backward_grad_sync``) and issues its collectives;
    holds no reducer, and the parameters stay wherever they are (the meta device, then fake storage)."""

    def __init__(self, module: torch.nn.Module, *, process_group: dist.ProcessGroup | None = None,
                 bucket_cap_mb: int | None = None, find_unused_parameters: bool = False,
                 static_graph: bool = False, gradient_as_bucket_view: bool = False,
                 broadcast_buffers: bool = True, compress_to: torch.dtype | None = None) -> None:
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        #: The comm hook's compression (``fp16_compress_hook``/``bf16_compress_hook``), or None.
        self.compress_to = compress_to
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self._ignored = ignored
        #: The reducer's parameters by name, in DDP's order (named_modules, then each module's own).
        self.parameter_names = [name for name, p in module.named_parameters() if p.requires_grad
                                and name not in ignored]
        sparse = {param for prefix, sub in _sparse_modules(module) for param in _own(sub, prefix)}
        if sparse & set(self.parameter_names):
            raise PlanningUnsupported(
                f"strategy 'ddp': {', '.join(sorted(sparse))} get sparse gradients (Embedding(sparse=True)); "
                "their all-reduce's size depends on the batch's indices, which the plan does not know")
        capacity = _BucketCapacityConfig.create(bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=None,
                                                use_python_reducer=False)
        #: The byte caps of a rebuilt bucket assignment: the first bucket, then every other (C++ Reducer).
        self.rebuild_limits = [capacity.first_bucket_bytes_cap, capacity.bucket_bytes_cap]
        #: Bucket -> parameter indices (into :attr:`parameter_names`), in the order they are reduced.
        self.bucket_indices: list[list[int]] | None = None
        if find_unused_parameters and not static_graph:  # DDP never rebuilds these buckets
            limits, _ = capacity.compute_bucket_size_limits(static_graph=False, find_unused_parameters=True)
            assigned, _ = dist._compute_bucket_assignment_by_size(self._parameters_now(), limits, [])
            self.bucket_indices = [list(bucket) for bucket in reversed(assigned)]
        self._hooked: list[Any] = []
        self._handles: list[Any] = []
        self._sync_backward = False
        self._pass: _BackwardPass | None = None
        self._bucket_buffers: dict[tuple[int, ...], torch.Tensor] = {}
        #: Until the bucket buffers exist: storage of their size, as the reducer holds its buckets from
        #: construction (before the first backward fixes the assignment).
        self._reserved: list[torch.Tensor] = []

    # ------------------------------------------------------------------ what DDP offers

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside it are followed by backwards that reduce nothing (DDP decides at forward)."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.require_forward_param_sync and self.broadcast_buffers:
            self._broadcast_buffers()
        self._hook_parameters()
        output = self.module(*args, **kwargs)
        self._sync_backward = torch.is_grad_enabled() and self.require_backward_grad_sync
        self.require_forward_param_sync = self._sync_backward
        self._pass = None
        return output

    @property
    def bucket_bytes(self) -> list[int]:
        """Bytes of each bucket's flat gradient, in reduction order (after the assignment is known)."""
        if self.bucket_indices is None:
            return []
        parameters = self._parameters_now()
        return [sum(parameters[i].numel() * parameters[i].element_size() for i in bucket)
                for bucket in self.bucket_indices]

    # ------------------------------------------------------------------ the reducer's traffic

    def _group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _parameters_now(self) -> list[torch.Tensor]:
        """The reducer's parameters as they are now (giving the module fake storage replaces them)."""
        named = dict(self.module.named_parameters())
        return [named[name] for name in self.parameter_names]

    def _hook_parameters(self) -> None:
        parameters = self._parameters_now()
        if len(parameters) == len(self._hooked) and all(a is b for a, b in zip(parameters, self._hooked)):
            return
        for handle in self._handles:
            handle.remove()
        self._hooked = parameters
        if not self._bucket_buffers:
            self._reserve_buckets(parameters)
        self._handles = [parameter.register_post_accumulate_grad_hook(self._ready_hook(index))
                         for index, parameter in enumerate(parameters)]

    def _ready_hook(self, index: int) -> Any:
        def ready(parameter: torch.Tensor) -> None:
            if not self._sync_backward:
                return
            if self._pass is None:
                self._pass = _BackwardPass(self)
                torch.autograd.Variable._execution_engine.queue_callback(self._pass.finish)
            self._pass.ready(index)

        return ready

    def _reserve_buckets(self, parameters: Sequence[torch.Tensor]) -> None:
        """Hold the bytes of every bucket (one tensor per dtype) until the assignment is known."""
        sizes: dict[torch.dtype, int] = {}
        for parameter in parameters:
            if parameter.requires_grad:
                sizes[parameter.dtype] = sizes.get(parameter.dtype, 0) + parameter.numel()
        device = parameters[0].device if parameters else None
        self._reserved = [torch.empty(size, dtype=dtype, device=device) for dtype, size in sizes.items()]

    def _allocate_buckets(self, first: Sequence[int]) -> None:
        """Every bucket's flat buffer at once (the assignment is known when the first bucket is reduced),
        the reserved bytes given back."""
        parameters = self._hooked
        for bucket in self.bucket_indices or [list(first)]:
            key = tuple(bucket)
            if key not in self._bucket_buffers:
                self._bucket_buffers[key] = torch.empty(sum(parameters[i].numel() for i in bucket),
                                                        dtype=parameters[bucket[0]].dtype,
                                                        device=parameters[bucket[0]].device)
        self._reserved = []

    @torch.no_grad()
    def _reduce(self, indices: Sequence[int]) -> None:
        """One bucket: copy its gradients into the bucket's flat buffer (kept across steps, as the
        reducer's), divide by the group size, all-reduce, and give the gradients the result back
        (or make them views of the bucket, ``gradient_as_bucket_view``)."""
        parameters = self._hooked
        group = self._group()
        world = dist.get_world_size(group)
        grads = [parameters[i].grad for i in indices]
        key = tuple(indices)
        if key not in self._bucket_buffers:  # the reducer's buckets: allocated once, kept across steps
            self._allocate_buckets(indices)
        flat = self._bucket_buffers[key]
        offset = 0
        for grad in grads:
            flat[offset:offset + grad.numel()].copy_(grad.reshape(-1))
            offset += grad.numel()
        if self.compress_to is not None:  # default_hooks.fp16/bf16_compress_hook
            compressed = flat.to(self.compress_to).div_(world)
            dist.all_reduce(compressed, group=group)
            flat.copy_(compressed)
        else:
            flat.div_(world)
            dist.all_reduce(flat, group=group)
        offset = 0
        for i, grad in zip(indices, grads):
            view = flat[offset:offset + grad.numel()].view_as(grad)
            offset += grad.numel()
            if self.gradient_as_bucket_view:
                parameters[i].grad = view
            else:
                grad.copy_(view)

    @torch.no_grad()
    def _reduce_used_map(self) -> None:
        """``find_unused_parameters``: once the last bucket is launched, the reducer all-reduces which
        parameters this rank used (an int32 per parameter), every step."""
        if self.find_unused_parameters and not self.static_graph:
            used = torch.zeros(len(self.parameter_names), dtype=torch.int32, device=self._hooked[0].device)
            dist.all_reduce(used, group=self._group())

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        """``DistributedDataParallel._sync_buffers``: rank 0's buffers, coalesced as ``_broadcast_coalesced`` does."""
        buffers = [b for name, b in self.module.named_buffers() if name not in self._ignored]
        if not buffers:
            return
        group = self._group()
        source = dist.get_global_rank(group, 0) if group is not dist.group.WORLD else 0
        assigned, _ = dist._compute_bucket_assignment_by_size(buffers, [BROADCAST_BUCKET_BYTES], [])
        for bucket in assigned:
            tensors = [buffers[i] for i in bucket]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=source, group=group)
            offset = 0
            for tensor in tensors:
                tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


class _BackwardPass:
    """One synchronised backward: which gradients are ready, which buckets are reduced.

    Before the buckets are known (the first synchronised backward, DDP's rebuild), a bucket closes
    as soon as its gradients reach the current byte cap — the greedy rule of
    ``_compute_bucket_assignment_by_size`` run as the gradients arrive — and is reduced then; at the
    end, torch's own function over the recorded order confirms the closed buckets and orders the rest."""

    def __init__(self, ddp: PlannedDistributedDataParallel) -> None:
        self.ddp = ddp
        self.order: list[int] = []
        self.reduced = 0
        # building the assignment: per (dtype, device), the open bucket, its size and its cap's position
        self.open: dict[tuple[Any, Any], tuple[list[int], int, int]] = {}
        self.closed: list[list[int]] = []

    def ready(self, index: int) -> None:
        self.order.append(index)
        if self.ddp.bucket_indices is None:
            self._assign(index)
        else:
            self._reduce_ready_buckets()

    def _assign(self, index: int) -> None:
        parameter = self.ddp._hooked[index]
        key = (parameter.dtype, parameter.device)
        members, size, cap = self.open.get(key, ([], 0, 0))
        members = [*members, index]
        size += parameter.numel() * parameter.element_size()
        limits = self.ddp.rebuild_limits
        if size >= limits[cap]:
            self.closed.append(members)
            self.ddp._reduce(members)
            self.open[key] = ([], 0, min(cap + 1, len(limits) - 1))
        else:
            self.open[key] = (members, size, cap)

    def _reduce_ready_buckets(self) -> None:
        buckets = self.ddp.bucket_indices
        assert buckets is not None
        done = set(self.order)
        while self.reduced < len(buckets) and all(i in done for i in buckets[self.reduced]):
            self.ddp._reduce(buckets[self.reduced])
            self.reduced += 1
            if self.reduced == len(buckets):
                self.ddp._reduce_used_map()

    def finish(self) -> None:
        """End of backward: the rebuilt assignment fixed, and the buckets left reduced."""
        ddp = self.ddp
        seen = set(self.order)
        missing = [name for i, name in enumerate(ddp.parameter_names) if i not in seen]
        if ddp.bucket_indices is None:
            if missing:
                raise _unused_error(missing, ddp.static_graph)
            parameters = ddp._hooked
            assigned, _ = dist._compute_bucket_assignment_by_size(
                [parameters[i] for i in self.order], ddp.rebuild_limits, [], self.order)
            assigned = [list(bucket) for bucket in assigned]
            if assigned[:len(self.closed)] != self.closed:
                raise RuntimeError("the DDP planning stand-in closed its buckets differently from "
                                   "torch.distributed._compute_bucket_assignment_by_size (a torch change?): "
                                   f"{self.closed} vs {assigned}")
            for bucket in assigned[len(self.closed):]:
                ddp._reduce(bucket)
            ddp.bucket_indices = assigned
            return
        if missing and not ddp.find_unused_parameters:
            raise _unused_error(missing, ddp.static_graph)
        if self.reduced == len(ddp.bucket_indices):
            return
        for bucket in ddp.bucket_indices[self.reduced:]:  # unused parameters: DDP reduces their zeros too
            for i in bucket:
                parameter = ddp._hooked[i]
                if parameter.grad is None:
                    parameter.grad = torch.zeros_like(parameter)
            ddp._reduce(bucket)
        self.reduced = len(ddp.bucket_indices)
        ddp._reduce_used_map()


def _unused_error(missing: Sequence[str], static_graph: bool) -> Exception:
    if static_graph:
        return PlanningUnsupported(
            f"strategy 'ddp': static_graph with parameters that get no gradient ({', '.join(missing)}): DDP "
            "reduces those after the first step in an order the plan does not reproduce")
    return RuntimeError(
        "DistributedDataParallel would fail at the next step: these parameters got no gradient in the "
        f"backward pass: {', '.join(missing)}; set ddp_config.find_unused_parameters: true (or use them in "
        "the loss)")


def _sparse_modules(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(name, sub) for name, sub in module.named_modules()
            if isinstance(sub, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and sub.sparse]


def _own(module: torch.nn.Module, prefix: str) -> list[str]:
    return [f"{prefix}.{name}" if prefix else name for name, _ in module.named_parameters(recurse=False)]


__all__ = ["BROADCAST_BUCKET_BYTES", "PlannedDistributedDataParallel"]
