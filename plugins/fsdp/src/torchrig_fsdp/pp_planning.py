"""The pipelined step of a planned run (``torchrig plan``): torch's own schedule, on the fake process group.

Why torch's schedule and not a copy of it: the order of forwards, backwards and point-to-point
transfers per micro-batch (1F1B, GPipe, Interleaved1F1B), the FSDP2 handling around them (gradient
sync and resharding only after the last micro-batch, gradients divided by the micro-batch count) are
exactly what a real step of this rank does only if the same code issues them. Two parts of a first
real step cannot run where this process is the only rank, and both are set-up, not the steady step
the plan records:

* the warm-up vote (``_warmup_p2p``): each stage sends a tensor and reads its peers' answer
  (``.item()``) to choose between static and dynamic metadata — a fake tensor has no value;
* dynamic metadata inference: a stage receives its input's shape as a Python object from the
  previous stage, which nobody sends in a fake world.

So the planned stages are built in torch's *static* mode (``PipelineStage(input_args=, output_args=)``,
the boundary tensors known in advance, :func:`boundary_metas`) and the vote is replaced by that
decision (:class:`_StaticWarmup`). Everything else — ``dist.isend``/``irecv`` and batched P2P of the
boundary activations and their gradients to the same peers, each micro-batch's forward and backward
under ``FakeTensorMode`` — is torch's step. torch's run-time metadata validation is switched on for
the planned stages, so a boundary guessed wrong is an error, never a silently wrong byte count.

Where the boundary comes from: a stage split from a transformers model's own plan
(:class:`~torchrig_fsdp.pp_plan.PlanStage`) passes the hidden states, ``(micro-batch, sequence,
hidden_size)``; a user split (``pp_split_points``/``pp_split_fn``) is probed: the stages before this
one are rebuilt by the same split from a meta-device copy of the unsplit model (kept at ``prepare``
when planning) and chained on a meta micro-batch. Floating tensors then take the dtype the stage's
FSDP2 root returns (its policy's ``output_dtype``, else ``param_dtype``).

Seams of torch 2.13 this relies on (private, checked by plugins/fsdp/tests/test_pipeline_planning.py):
``_PipelineSchedule._warmup_p2p``, ``PipelineStage._inference_mode`` and ``_runtime_validate``, an FSDP2
module's ``_get_fsdp_state()._mp_policy``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import InferenceMode, PipeliningMetadataError
from torch.utils._python_dispatch import _disable_current_modes
from torchrig.plugin import PlanningUnsupported

from torchrig_fsdp.pp_plan import PlanStage

#: (input tensors, output tensors) of one stage for one micro-batch, as meta tensors.
Boundary = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


class _StaticWarmup:
    """Mixed into a planned schedule: every stage's metadata is given (static mode), which is what
    the warm-up vote would decide; the vote itself (a send, then ``.item()`` of the received
    answer) cannot run on a fake process group and is not part of a steady step."""

    def _warmup_p2p(self, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC


_PLANNED_CLASSES: dict[type, type] = {}


def planned_class(schedule_class: type) -> type:
    """``schedule_class`` with the warm-up vote replaced by the static decision (:class:`_StaticWarmup`)."""
    if schedule_class not in _PLANNED_CLASSES:
        _PLANNED_CLASSES[schedule_class] = type(f"Planned{schedule_class.__name__}", (_StaticWarmup, schedule_class), {})
    return _PLANNED_CLASSES[schedule_class]


def _meta_like(tensor: torch.Tensor, dtype: torch.dtype | None = None, requires_grad: bool = False) -> torch.Tensor:
    return torch.empty(tuple(tensor.shape), dtype=dtype or tensor.dtype, device="meta").requires_grad_(requires_grad)


def _stage_dtype(module: torch.nn.Module, computed: torch.dtype) -> torch.dtype:
    """The dtype a stage's floating output leaves it in: its FSDP2 root casts it to ``output_dtype``,
    and it was computed in ``param_dtype`` when one is set."""
    if isinstance(module, FSDPModule):
        policy = module._get_fsdp_state()._mp_policy
        return policy.output_dtype or policy.param_dtype or computed
    return computed


def _as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    values = value if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(item, torch.Tensor) for item in values):
        kinds = ", ".join(type(item).__name__ for item in values)
        raise ValueError(f"a pipeline stage passes tensors to the next one; a probed stage returned {kinds}")
    return tuple(values)


class BoundaryProbe:
    """Finds each stage's input and output tensors for a micro-batch of token ids.

    ``unsplit``: a meta-device copy of the whole model taken before the split (user splits only);
    ``build(model, stage)``: the split the real ranks make."""

    def __init__(self, num_stages: int, unsplit: torch.nn.Module | None,
                 build: Callable[[torch.nn.Module, int], torch.nn.Module] | None) -> None:
        self.num_stages = num_stages
        self._unsplit = unsplit
        self._build = build
        self._cache: dict[tuple[int, ...], list[tuple[torch.Tensor, ...]]] = {}

    def boundaries(self, ids: torch.Tensor, stages: list[tuple[int, torch.nn.Module]]) -> dict[int, Boundary]:
        """For each of ``stages`` (``(index, module)``, this rank's), its (inputs, outputs) on ``ids``
        (one micro-batch of token ids), as meta tensors; inputs after the first stage require grad."""
        last = max(index for index, _ in stages)
        chain = self._chain(ids, stages, last)
        result = {}
        for index, module in stages:
            inputs = (_meta_like(ids),) if index == 0 else tuple(
                _meta_like(t, _stage_dtype(module, t.dtype) if t.is_floating_point() else None, t.is_floating_point())
                for t in chain[index - 1])
            outputs = tuple(_meta_like(t, _stage_dtype(module, t.dtype) if t.is_floating_point() else None,
                                       t.is_floating_point()) for t in chain[index])
            result[index] = (inputs, outputs)
        return result

    def _chain(self, ids: torch.Tensor, stages: list[tuple[int, torch.nn.Module]], last: int
               ) -> list[tuple[torch.Tensor, ...]]:
        """The outputs of stages 0..``last`` on ``ids``, as meta tensors."""
        module = stages[0][1]
        if isinstance(module, PlanStage):
            return [self._plan_stage_output(module, ids, index) for index in range(last + 1)]
        key = (*ids.shape, last)
        if key not in self._cache:
            if self._unsplit is None or self._build is None:
                raise ValueError("pipeline planning: no meta copy of the unsplit model was kept to probe the stage "
                                 "boundaries of a user split")
            outputs = []
            try:
                with _disable_current_modes(), torch.no_grad():  # meta tensors only: nothing recorded or allocated
                    value: tuple[torch.Tensor, ...] = (torch.zeros(tuple(ids.shape), dtype=ids.dtype, device="meta"),)
                    for index in range(last + 1):
                        stage = self._build(copy.deepcopy(self._unsplit), index)
                        value = _as_tuple(stage(*value))
                        outputs.append(tuple(_meta_like(t) for t in value))
            except Exception as exc:  # noqa: BLE001 — whatever the user's model raises on the meta device
                raise PlanningUnsupported(
                    f"pipeline stage {len(outputs)}: the tensors it passes on cannot be found on the meta device (the "
                    f"plan runs the stages before this rank's on a meta copy of the unsplit model): "
                    f"{type(exc).__name__}: {exc}") from exc
            self._cache[key] = outputs
        return self._cache[key]

    def _plan_stage_output(self, module: PlanStage, ids: torch.Tensor, index: int) -> tuple[torch.Tensor, ...]:
        """A stage split from the model's own plan passes the hidden states; the last returns the logits."""
        config = module.model.config
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        width = config.vocab_size if index == self.num_stages - 1 else config.hidden_size
        return (torch.empty((*ids.shape, width), dtype=dtype, device="meta"),)


def planned_stages(stages: list[tuple[int, torch.nn.Module]], boundaries: dict[int, Boundary], num_stages: int,
                   device: torch.device, group: Any) -> list[PipelineStage]:
    """This rank's stages in torch's static mode, validating at run time what passes between them."""
    planned = []
    for index, module in stages:
        inputs, outputs = boundaries[index]
        stage = PipelineStage(module, index, num_stages, device, input_args=inputs, output_args=outputs, group=group)
        stage._runtime_validate = True  # a wrong boundary is an error, not a wrong byte count
        planned.append(stage)
    return planned


def run_planned(step: Callable[[], None]) -> None:
    """``step``: the planned schedule's step. A boundary that differs from what was probed (torch's run-time
    validation) is a limit of the plan, not a failure of the target run."""
    try:
        step()
    except PipeliningMetadataError as exc:
        raise PlanningUnsupported(f"pipeline planning: a stage passed other tensors than the plan found for its "
                                  f"boundary ({exc}); the plan supports plain tensors between stages") from exc


__all__ = ["BoundaryProbe", "planned_class", "planned_stages", "run_planned"]
