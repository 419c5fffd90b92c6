"""Peak memory of one training step by category, from the lifetimes of the step's storages.

Why our own tracker rather than torch's ``MemTracker`` / ``FSDPMemTracker`` (torch 2.13): both run
on CPU under ``FakeTensorMode`` with FSDP2 on the fake process group, but they categorise a storage
when it is created and never again, so their peak snapshot disagrees with itself (measured: a
sharded 2-layer FSDP2 model with AdamW showed 0 B of gradients at a peak reached inside
``optimizer.step`` — gradients were filed under "temporary" — and ``FSDPMemTracker`` counted 4x the
Adam state). Here a storage's category is decided at the end of the step, from what it then is
(a parameter's, a gradient's, an optimizer state's storage), so a number is right wherever the
peak falls:

* every storage an operator takes or returns under the mode is followed (a ``weakref.finalize``
  on the untyped storage ends it; storages keep their Python object alive while they live);
  its size is re-read when ``UntypedStorage.resize_`` changes it (FSDP2 frees and re-allocates
  unsharded parameters that way; the method is wrapped while the tracker is entered, as torch's
  ``MemTracker`` does);
* ``_c10d_functional.wait_tensor`` returns its input in a real run but a new tensor under
  ``FakeTensorMode``: the bytes are handed over to the new one, not counted twice;
* at each new peak the live sizes are copied (a dict copy: cheap next to the operator itself);
* categories at the end: ``parameters`` (the local tensors of the model's parameters),
  ``gradients`` (their ``.grad``, looked at before each optimizer step and at the end),
  ``optimizer_state`` (tensors in the optimizers' ``state``), ``buffers``, ``activations`` (created
  in the forward phase, none of the above, not resized), ``temporaries`` (the rest: backward and
  optimizer scratch, FSDP2's unsharded parameters and communication buffers).

Works on real tensors too, so a real run and a fake one are measured by the same rules.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Self

import attrs
import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    is_traceable_wrapper_subclass,
    is_traceable_wrapper_subclass_type,
)
from torch.utils._pytree import tree_leaves

from torchrig.estimate.step_phase import StepPhases

_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default

#: The categories of :attr:`StepMemory.by_category`, in display order.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "buffers", "activations", "temporaries")


@attrs.frozen
class StepMemory:
    """Peak bytes of one rank's step, split by category at the peak (:data:`CATEGORIES`), the phase
    the peak was reached in, and what stays after the step (``end_by_category``)."""

    peak_bytes: int
    by_category: dict[str, int]
    peak_phase: str
    end_by_category: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class StepMemoryTracker(TorchDispatchMode):
    """The tracker :func:`track_step_memory` returns; :attr:`result` is set when it exits."""

    def __init__(self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer] = ()) -> None:
        super().__init__()
        self.model = model
        self.optimizers = list(optimizers)
        self.result: StepMemory | None = None
        self._phases = StepPhases()
        self._serials: dict[int, int] = {}  # storage address -> serial, while it lives
        self._live: dict[int, int] = {}  # serial -> bytes (serials are never reused; addresses are)
        self._total = 0  # sum of self._live, kept as it changes
        self._born_in: dict[int, str] = {}  # serial -> phase
        self._resized: set[int] = set()
        self._gradients: set[int | None] = set()
        self._peak = 0
        self._peak_live: dict[int, int] = {}
        self._peak_phase = "forward"
        self._unpatched_resize: Any = None
        self._hooks: list[Any] = []

    # ---------------------------------------------------------------- following storages

    def _follow(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        address = storage._cdata
        if address in self._serials:
            return
        key = self._serials[address] = len(self._born_in)
        self._set_bytes(key, storage.nbytes())
        self._born_in[key] = self._phases.phase
        weakref.finalize(storage, self._release, address, key)

    def _set_bytes(self, key: int, nbytes: int) -> None:
        self._total += nbytes - self._live.get(key, 0)
        self._live[key] = nbytes

    def _release(self, address: int, key: int) -> None:
        self._total -= self._live.pop(key, 0)
        if self._serials.get(address) == key:
            del self._serials[address]

    def _serial(self, tensor: torch.Tensor) -> int | None:
        return self._serials.get(_local(tensor).untyped_storage()._cdata)

    def _note_peak(self) -> None:
        if self._total > self._peak:
            self._peak = self._total
            self._peak_live = dict(self._live)
            self._peak_phase = self._phases.phase

    def _resize(self, storage: torch.UntypedStorage, size: int) -> Any:
        out = self._unpatched_resize(storage, size)
        key = self._serials.get(storage._cdata)
        if key is not None:
            self._set_bytes(key, storage.nbytes())
            self._resized.add(key)
            self._note_peak()
        return out

    def __torch_dispatch__(self, func: Any, types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        if any(is_traceable_wrapper_subclass_type(kind) for kind in types):
            return NotImplemented  # wrapper subclasses (DTensor, AsyncCollectiveTensor) own no memory: their plain ops come back
        out = func(*args, **(kwargs or {}))
        if not self._phases.propagating:
            for leaf in tree_leaves((args, kwargs, out)):
                if isinstance(leaf, torch.Tensor) and not is_traceable_wrapper_subclass(leaf):
                    self._follow(leaf)
            if func is _WAIT_TENSOR:
                self._hand_over(args[0], out)
            self._note_peak()
        return out

    def _hand_over(self, waited: torch.Tensor, result: torch.Tensor) -> None:
        """A real ``wait_tensor`` returns its input; the fake one returns a new tensor. Count the
        bytes once, on the result (the input is rarely used after its wait)."""
        source, target = self._serial(waited), self._serial(result)
        if source is not None and target is not None and source != target:
            self._set_bytes(source, 0)

    # ---------------------------------------------------------------- categories

    def _note_gradients(self, *_: Any) -> None:
        for parameter in self.model.parameters():
            if parameter.grad is not None:
                self._gradients.add(self._serial(parameter.grad))

    def _known(self) -> dict[int | None, str]:
        known: dict[int | None, str] = {}
        for optimizer in self.optimizers:
            for tensor in _state_tensors(optimizer.state.values()):
                known[self._serial(tensor)] = "optimizer_state"
        self._note_gradients()
        known.update(dict.fromkeys(self._gradients, "gradients"))
        known.update({self._serial(b): "buffers" for b in self.model.buffers()})
        known.update({self._serial(p): "parameters" for p in self.model.parameters()})
        known.pop(None, None)
        return known

    def _by_category(self, live: Mapping[int, int], known: Mapping[int | None, str]) -> dict[str, int]:
        totals = dict.fromkeys(CATEGORIES, 0)
        for key, nbytes in live.items():
            category = known.get(key)
            if category is None:
                forward = self._born_in.get(key) == "forward" and key not in self._resized
                category = "activations" if forward else "temporaries"
            totals[category] += nbytes
        return totals

    # ---------------------------------------------------------------- context

    def __enter__(self) -> Self:
        self._phases.__enter__()
        for tensor in (*self.model.parameters(), *self.model.buffers()):
            self._follow(_local(tensor))
        self._note_gradients()
        for optimizer in self.optimizers:
            for tensor in _state_tensors(optimizer.state.values()):
                self._follow(_local(tensor))
            self._hooks.append(optimizer.register_step_pre_hook(self._note_gradients))
        self._unpatched_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:
            return tracker._resize(storage, size)

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._note_peak()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._unpatched_resize  # type: ignore[method-assign]
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._phases.__exit__(*exc)
        known = self._known()
        self.result = StepMemory(peak_bytes=self._peak, by_category=self._by_category(self._peak_live, known),
                                 peak_phase=self._peak_phase, end_by_category=self._by_category(self._live, known))


def _state_tensors(states: Iterable[Mapping[str, Any]]) -> Iterator[torch.Tensor]:
    for state in states:
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def track_step_memory(model: torch.nn.Module,
                      optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = ()) -> StepMemoryTracker:
    """A context to run one step in; its ``result`` (:class:`StepMemory`) is set on exit.

    ``model``'s parameters, buffers and gradients and ``optimizers``' state are what the categories
    of the same names count (give every optimizer of the step)."""
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    return StepMemoryTracker(model, optimizers)


__all__ = ["CATEGORIES", "StepMemory", "StepMemoryTracker", "track_step_memory"]
