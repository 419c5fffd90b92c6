"""The DeepSpeed engines of a run: building one per prepared model and finding them again.

``build_engine`` turns a model (with its optimizer and scheduler) into a ``deepspeed.initialize``
engine, fills the DeepSpeed configuration (:mod:`torchrig_deepspeed.ds_config`) and keeps an
:class:`EngineRecord` in the run's stash. The step plan, the clipping and the checkpoints find
an engine from what the script holds: a module, an optimizer, a loss (its autograd graph).

DeepSpeed is imported by ``build_engine``, never at import of this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import torch
from torchrig.plugin import CoreOptions, DataLoaderConfiguration, PreparedModel, RunContext, StashKey

from torchrig_deepspeed import checkpoint as ds_checkpoint
from torchrig_deepspeed.config_checks import SECTION
from torchrig_deepspeed.ds_config import EngineConfig, engine_config, micro_batch_of
from torchrig_deepspeed.jit_ops import watching_jit_builds
from torchrig_deepspeed.options import DeepSpeedPlugin
from torchrig_deepspeed.placeholders import DummyScheduler, EngineBuiltScheduler


class DeepSpeedStrategyError(RuntimeError):
    """The deepspeed strategy cannot do what the script asked; the message says how to fix it."""


@attrs.define(eq=False)
class EngineRecord:
    """One prepared model's engine and what the step plan needs to find it fast."""

    #: Position among the models prepared in this run (names its checkpoint tag).
    index: int
    engine: Any
    #: The user's module (``engine.module``).
    module: Any
    #: ``id`` of every trainable parameter (for ``backward`` and ``clip_grad_norm_``).
    params: frozenset[int]
    #: The optimizer handed back by ``prepare`` (DeepSpeed's basic optimizer: the script's own, or
    #: the one built from the JSON's ``optimizer`` block); None for a model without one.
    optimizer: Any
    built: EngineConfig
    #: Optimizer steps the engine applied (not skipped on overflow); schedulers follow it.
    applied_steps: int = 0

    @property
    def tag(self) -> str:
        return ds_checkpoint.tag_for(self.index)


#: Engines of this run, in prepare order.
ENGINES = StashKey[list[EngineRecord]]("deepspeed.engines")
#: Dataloaders prepared in this run (their batch size fills train_micro_batch_size_per_gpu).
LOADERS = StashKey[list[Any]]("deepspeed.dataloaders")


def deepspeed_options(run: RunContext) -> DeepSpeedPlugin:
    """The resolved ``deepspeed_config`` section."""
    return run.section(DeepSpeedPlugin)


def engines_of(run: RunContext) -> list[EngineRecord]:
    return run.stash.setdefault(ENGINES, [])


def record_of_module(run: RunContext, module: Any) -> EngineRecord | None:
    for record in engines_of(run):
        if module is record.module or module is record.engine:
            return record
    return None


def record_of_optimizer(run: RunContext, optimizer: Any) -> EngineRecord | None:
    """The engine of an optimizer ``prepare`` handed back (or of the prepared wrapper around it)."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        for record in engines_of(run):
            if record.optimizer is not None and candidate is not None and (
                    candidate is record.optimizer or candidate is record.engine.optimizer):
                return record
    return None


def record_of_loss(records: Sequence[EngineRecord], loss: torch.Tensor) -> EngineRecord | None:
    trainable = [r for r in records if r.optimizer is not None]
    if len(trainable) == 1:
        return trainable[0]
    if not trainable:
        return None
    found = _engines_in_graph(trainable, loss)
    if len(found) == 1:
        return found[0]
    if not found:
        return None
    names = ", ".join(f"#{r.index} ({type(r.module).__name__})" for r in found)
    raise DeepSpeedStrategyError(
        f"deepspeed: this loss depends on the trainable parameters of models {names}, each its own DeepSpeed engine; "
        "one backward goes to one engine. Freeze the model that should not learn from it "
        "(model.requires_grad_(False) around that forward) or detach its output, and backward each model's loss "
        "separately")


def _engines_in_graph(records: Sequence[EngineRecord], loss: torch.Tensor) -> list[EngineRecord]:
    """The engines whose trainable parameters the loss's autograd graph reaches (its leaves)."""
    owner = {pid: record for record in records for pid in record.params}
    found: dict[int, EngineRecord] = {}
    stack = [loss.grad_fn] if loss.grad_fn is not None else []
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            record = owner.get(id(variable))
            if record is not None:
                found[record.index] = record
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return [found[i] for i in sorted(found)]


def records_for(run: RunContext, prepared: Sequence[PreparedModel]) -> list[EngineRecord]:
    records = []
    for item in prepared:
        record = record_of_module(run, item.unwrapped)
        if record is None:
            raise DeepSpeedStrategyError(f"deepspeed: {type(item.unwrapped).__name__} was not prepared by the deepspeed "
                                         "strategy of this Accelerator")
        records.append(record)
    return records


# -- building ------------------------------------------------------------------------------------------


def build_engine(run: RunContext, model: Any, optimizers: Sequence[Any], schedulers: Sequence[Any],
                 device_placement: bool, accumulation_steps: int) -> PreparedModel:
    """One engine for ``model`` and its optimizer (and scheduler), built with the run's
    ``accumulation_steps``; recorded in the run's stash in prepare order."""
    deepspeed = _import_deepspeed(run)
    if len(optimizers) > 1:
        raise DeepSpeedStrategyError(
            f"deepspeed: {type(model).__name__} has {len(optimizers)} optimizers over its parameters, but a DeepSpeed "
            "engine drives one; use one optimizer with several param groups")
    options = deepspeed_options(run)
    records = engines_of(run)
    optimizer = optimizers[0] if optimizers else None
    built = engine_config(
        options, mixed_precision=str(run.section(CoreOptions).mixed_precision or "no"),
        accumulation_steps=accumulation_steps, world_size=run.cluster.world_size,
        micro_batch=micro_batch_of(run.stash.get(LOADERS) or [], options.is_train_batch_min),
        model=model, optimizer=optimizer, scheduler=schedulers[0] if schedulers else None,
        split_batches=bool(run.section(DataLoaderConfiguration).split_batches))
    if not records:  # Accelerate's deepspeed_plugin.deepspeed_config shows the first engine's configuration
        built.config = options.adopt_engine_config(built.config)
    placeholder = bool(schedulers) and isinstance(schedulers[0], DummyScheduler)
    if built.builds_optimizer and schedulers and not placeholder:
        raise DeepSpeedStrategyError(
            f"deepspeed: the DeepSpeed config builds the optimizer ('optimizer' block), so a scheduler over the "
            f"script's {type(optimizer).__name__} would not drive it; use a 'scheduler' block in the DeepSpeed "
            "config, or remove the 'optimizer' block to train with the script's optimizer")
    assert run.device is not None
    if device_placement:
        model.to(run.device.device)
    _mark_leaf_modules(deepspeed, model, options.deepspeed_moe_layer_cls_names)
    kwargs: dict[str, Any] = {"model": model, "config": built.config}
    if built.builds_optimizer:
        kwargs["model_parameters"] = _parameter_groups(model, optimizer)
    elif optimizer is not None:
        kwargs["optimizer"] = optimizer
    if built.scheduler_callable is not None:
        kwargs["lr_scheduler"] = built.scheduler_callable
    try:
        with watching_jit_builds(deepspeed, rank=run.cluster.rank, local_rank=run.cluster.local_rank,
                                 patience=options.jit_lock_warning_seconds):
            engine, _, _, _ = deepspeed.initialize(**kwargs)
    except AssertionError as exc:  # DeepSpeed reports configuration problems as assertions
        raise DeepSpeedStrategyError(f"deepspeed.initialize refused the configuration of model #{len(records)} "
                                     f"({type(model).__name__}): {exc}") from exc
    handed_back = getattr(engine, "basic_optimizer", None) if (optimizer is not None or built.builds_optimizer) \
        else None
    record = EngineRecord(index=len(records), engine=engine, module=engine.module,
                          params=frozenset(id(p) for p in engine.module.parameters() if p.requires_grad),
                          optimizer=handed_back, built=built)
    records.append(record)
    _cast_at_the_boundary(engine)
    prepared_schedulers = [EngineBuiltScheduler(engine.lr_scheduler, handed_back)] if placeholder else list(schedulers)
    return PreparedModel(model=engine, unwrapped=engine.module,
                         optimizers=[handed_back] if optimizers else [], schedulers=prepared_schedulers)

# -- building helpers ---------------------------------------------------------------------------------


def _import_deepspeed(run: RunContext) -> Any:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    assert run.device is not None
    want = run.device.device.type
    have = get_accelerator().device_name()
    if (want == "cpu") != (have == "cpu"):
        raise DeepSpeedStrategyError(
            f"deepspeed: this run uses the {want} device but DeepSpeed chose its {have!r} accelerator when it was "
            f"imported; set DS_ACCELERATOR={'cpu' if want == 'cpu' else 'cuda'} in the environment before starting "
            "(torchrig launch sets it on machines without a GPU)")
    return deepspeed


def _parameter_groups(model: Any, optimizer: Any) -> list[Any]:
    """Parameters for an optimizer DeepSpeed builds from the JSON: the script's optimizer's
    groups (only their weight decay when it differs between groups: the JSON's hyperparameters
    apply), or the model's trainable parameters."""
    if optimizer is None:
        return [p for p in model.parameters() if p.requires_grad]
    groups = optimizer.param_groups
    decays = {g.get("weight_decay") for g in groups}
    return [{"params": g["params"], **({"weight_decay": g["weight_decay"]} if len(decays) > 1 else {})} for g in groups]


def _mark_leaf_modules(deepspeed: Any, model: Any, names: Iterable[str] | None) -> None:
    """``deepspeed_moe_layer_cls_names``: ZeRO-3 gathers these modules whole (MoE blocks, whose
    experts run data-dependently)."""
    if not names:
        return
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise DeepSpeedStrategyError(
            f"{SECTION}.deepspeed_moe_layer_cls_names: no module of class {', '.join(repr(n) for n in missing)} in "
            f"{type(model).__name__}; its module classes are: {', '.join(sorted(present))}")
    from deepspeed.utils import set_z3_leaf_modules

    set_z3_leaf_modules(model, [present[n] for n in names])


def _cast_at_the_boundary(engine: Any) -> None:
    """bf16/fp16 engines hold low-precision parameters: floating-point inputs are cast to that
    dtype on the way in and floating-point outputs to fp32 on the way out, as the precision
    plugins' autocast does, so the same script runs under every strategy."""
    if engine.bfloat16_enabled():
        dtype = torch.bfloat16
    elif engine.fp16_enabled():
        dtype = torch.float16
    else:
        return

    def cast(value: Any, to: torch.dtype) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(to) if value.is_floating_point() and value.dtype != to else value
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            return type(value)(cast(v, to) for v in value)
        if isinstance(value, dict) and type(value) is dict:
            return {k: cast(v, to) for k, v in value.items()}
        return value

    def inputs(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        return cast(args, dtype), cast(kwargs, dtype)

    def outputs(module: Any, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return cast(output, torch.float32)
        if hasattr(output, "items") and hasattr(output, "__setitem__") and type(output) is not dict:
            for key in list(output.keys()):  # Hugging Face ModelOutput: keep its class
                output[key] = cast(output[key], torch.float32)
            return output
        return cast(output, torch.float32)

    engine.module.register_forward_pre_hook(inputs, with_kwargs=True)
    engine.module.register_forward_hook(outputs)


__all__ = ["ENGINES", "LOADERS", "DeepSpeedStrategyError", "EngineRecord", "build_engine", "deepspeed_options", "engines_of",
           "record_of_loss", "record_of_module", "record_of_optimizer", "records_for"]
