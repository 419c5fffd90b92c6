"""Collective operations over the run's ranks, for ``gather``/``reduce``/``broadcast``.

The default implementation uses torch.distributed; on one process every operation returns its
input (with the same shapes a multi-process call would give). A strategy or device whose
transport differs answers ``torchrig_collectives`` with its own subclass.

Nested structures (dicts, lists, tuples of tensors) are handled recursively; tensors whose
first dimension differs between ranks are padded for the transfer and trimmed afterwards, so
``gather`` returns exactly the rows each rank contributed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from torchrig.distributed.nested import pad_to, recursively_apply

_REDUCE_OPS = {"sum", "mean", "max", "min", "product"}


class Collectives:
    """torch.distributed collectives; identity when the run has one process."""

    def __init__(self, world_size: int = 1, group: Any = None) -> None:
        self.world_size = world_size
        self.group = group

    @property
    def active(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def barrier(self) -> None:
        if self.active:
            dist.barrier(group=self.group)

    def gather(self, data: Any) -> Any:
        """Concatenate every rank's tensors along dim 0 (0-d tensors become 1-d), on every rank."""
        return recursively_apply(self._gather_tensor, data)

    def _gather_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        if not self.active:
            return tensor
        tensor = tensor.contiguous()
        sizes = self._all_sizes(tensor, 0)
        max_rows = max(sizes)
        if tensor.shape[0] < max_rows:
            pad = tensor.new_zeros((max_rows - tensor.shape[0], *tensor.shape[1:]))
            tensor = torch.cat([tensor, pad], dim=0)
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor, group=self.group)
        return torch.cat([chunk[:rows] for chunk, rows in zip(out, sizes)], dim=0)

    def _all_sizes(self, tensor: torch.Tensor, dim: int) -> list[int]:
        """Every rank's size of ``dim`` of its ``tensor``."""
        if not self.active:
            return [int(tensor.shape[dim])]
        local = torch.tensor([tensor.shape[dim]], device=tensor.device, dtype=torch.long)
        sizes = [torch.zeros_like(local) for _ in range(self.world_size)]
        dist.all_gather(sizes, local, group=self.group)
        return [int(s.item()) for s in sizes]

    def pad_across(self, data: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
        """Pad ``dim`` of every tensor to its largest size over the ranks, with ``pad_index``
        (before the data with ``pad_first``), so the ranks' tensors can be gathered."""

        def pad(tensor: torch.Tensor) -> torch.Tensor:
            if getattr(tensor, "is_nested", False):
                return pad_to(tensor, 0, dim, pad_index, pad_first)  # warns, leaves it as it is
            if not -tensor.dim() <= dim < tensor.dim():
                return tensor
            axis = dim % tensor.dim()
            return pad_to(tensor, max(self._all_sizes(tensor, axis)), axis, pad_index, pad_first)

        return recursively_apply(pad, data)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable object, as a list indexed by rank (lists are flattened)."""
        if not self.active:
            return list(obj) if isinstance(obj, list) else [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        if all(isinstance(o, list) for o in out):
            return [item for sub in out for item in sub]
        return out

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        """Element-wise reduction of every rank's tensors, on every rank."""
        if reduction not in _REDUCE_OPS:
            raise ValueError(f"reduction must be one of {sorted(_REDUCE_OPS)}, not {reduction!r}")
        return recursively_apply(lambda t: self._reduce_tensor(t, reduction), data)

    def _reduce_tensor(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        result = tensor.clone()
        if not self.active:
            return result
        op = {
            "sum": dist.ReduceOp.SUM,
            "mean": dist.ReduceOp.SUM,
            "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN,
            "product": dist.ReduceOp.PRODUCT,
        }[reduction]
        dist.all_reduce(result, op=op, group=self.group)
        if reduction == "mean":
            result = result / self.world_size
        return result

    def broadcast(self, data: Any, src: int = 0) -> Any:
        """Every rank receives rank ``src``'s tensors (same shapes on every rank required)."""

        def _bcast(tensor: torch.Tensor) -> torch.Tensor:
            if self.active:
                tensor = tensor.contiguous()
                dist.broadcast(tensor, src=src, group=self.group)
            return tensor

        return recursively_apply(_bcast, data)

    def broadcast_object_list(self, objects: list[Any], src: int = 0) -> list[Any]:
        """In place: every rank's ``objects`` become rank ``src``'s."""
        if self.active:
            dist.broadcast_object_list(objects, src=src, group=self.group)
        return objects


__all__ = ["Collectives"]
