"""The Accelerator's collective calls: gather, reduce and padding over every process or over the
data-parallel ranks only, and the cross-process trigger.

A module of its own because "which ranks" is a question of its own once a mesh exists: tensor,
context and pipeline-parallel ranks share their batches, so metrics gather over the data-parallel
group (``Capabilities.data_parallel_group``), while Accelerate's ``gather``/``reduce`` stay
world-wide unless asked (``over="data"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from torchrig.distributed.collectives import Collectives
from torchrig.distributed.nested import recursively_apply
from torchrig.distributed.process import ProcessControl


class CollectiveCalls(ProcessControl):
    """Collectives over ``self._run`` (the started run) for the :class:`~torchrig.Accelerator`."""

    flag_tensor: Any
    gradient_state: Any

    @property
    def _collectives(self) -> Any:
        assert self._run.collectives is not None
        return self._run.collectives

    def gather(self, tensor: Any, *, over: str = "world") -> Any:
        """Concatenate every process's tensors along dim 0 (nested structures, uneven sizes).
        ``over="data"``: only the data-parallel ranks (one per tensor/context-parallel group)."""
        return self._collectives_over(over).gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Gather for evaluation: on the last batch of a prepared dataloader, drop the samples
        repeated to make batches even, so metrics count every sample exactly once. Gathers over
        the data-parallel ranks (the ranks of a tensor-parallel group share their batches)."""
        tensors_only = not use_gather_object and _all_tensors(input_data)
        collectives = self._data_parallel_collectives()
        data = collectives.gather(input_data) if tensors_only else collectives.gather_object(input_data)
        state = self.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            if tensors_only:
                return recursively_apply(lambda t: t[: state.remainder], data)
            return data[: state.remainder]
        return data

    def _data_parallel_collectives(self) -> Any:
        caps = self._run.capabilities  # declared at the first prepare(), which every prepared loader went through
        if caps is None or caps.data_parallel_group is None:
            return self._collectives
        return Collectives(world_size=caps.data_parallel_size or 1, group=caps.data_parallel_group)

    def _collectives_over(self, over: str) -> Any:
        if over == "world":
            return self._collectives
        if over == "data":
            return self._data_parallel_collectives()
        raise ValueError(f"over={over!r}: choose 'world' (every process) or 'data' (the data-parallel ranks)")

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0, *, over: str = "world") -> Any:
        """Reduce across every process (``over="data"``: the data-parallel ranks only, so a ``sum``
        counts each sample once under tensor/context parallel)."""
        result = self._collectives_over(over).reduce(tensor, reduction)
        if scale != 1.0:
            result = recursively_apply(lambda t: t * scale, result)
        return result

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Pad ``dim`` of every tensor to the largest size over all processes."""
        return self._collectives.pad_across(tensor, dim, pad_index, pad_first)

    def set_trigger(self) -> None:
        """Raise a flag on this process that ``check_trigger`` sees on every process."""
        self.flag_tensor = torch.tensor(1, device=self.device)

    def check_trigger(self) -> bool:
        """Whether any process called ``set_trigger`` (collective; resets the flag)."""
        flag = self.flag_tensor if self.flag_tensor is not None else torch.tensor(0, device=self.device)
        if int(self._collectives.reduce(flag, "sum").item()) >= 1:
            self.flag_tensor = torch.tensor(0, device=self.device)
            return True
        return False


def _all_tensors(data: Any) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, Mapping):
        return all(_all_tensors(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return all(_all_tensors(v) for v in data)
    return False


__all__ = ["CollectiveCalls"]
