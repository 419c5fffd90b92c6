"""The DeepSpeed configuration an engine is built with: the user's JSON with every ``"auto"`` filled.

Where each value comes from (Accelerate's rules, written down once):

* ``train_micro_batch_size_per_gpu`` — the per-rank batch size of the prepared dataloaders (the
  smaller one with ``is_train_batch_min``, else the larger); when no dataloader is prepared yet
  it is provisional and corrected when one is (see :func:`micro_batch_of`);
* ``gradient_accumulation_steps`` — the run's accumulation steps (the core's, which the strategy
  aligns with ``deepspeed_config.gradient_accumulation_steps`` and a concrete JSON value);
* ``train_batch_size`` — micro × accumulation × data-parallel processes;
* ``gradient_clipping`` — ``deepspeed_config.gradient_clipping``; left unset (0, no clipping)
  otherwise, and then the first ``clip_grad_norm_(…, max_norm)`` sets it;
* ``fp16.enabled`` / ``bf16.enabled`` — ``mixed_precision``;
* ``zero_optimization`` — ``zero_stage`` (default 2, as in Accelerate), offload devices and NVMe
  paths, ``stage3_gather_16bit_weights_on_model_save`` from ``zero3_save_16bit_model``; the
  hidden-size dependent bucket sizes from the model's ``config.hidden_size`` (Hugging Face models),
  else DeepSpeed's defaults;
* ``optimizer.params`` — ``lr``, ``weight_decay``, ``betas``, ``eps`` of the optimizer the script
  passed to ``prepare`` (DeepSpeed then builds the JSON's optimizer in its place): a
  ``DummyOptim``'s ``lr``/``weight_decay``, or a torch optimizer's first parameter group;
* ``scheduler.params`` — ``warmup_max_lr``/``cycle_max_lr``… from that optimizer's learning rate,
  ``warmup_min_lr`` 0; with a ``DummyScheduler``, ``warmup_num_steps`` from it and
  ``total_num_steps`` from its ``total_num_steps`` (divided by the number of processes unless
  ``split_batches``, Accelerate's rule: the script counts the steps of the unsharded loader);
  otherwise step counts have no source and must be numbers.

A ``DummyOptim`` needs an ``optimizer`` block and a ``DummyScheduler`` a ``scheduler`` block (or its
``lr_scheduler_callable``, which builds the scheduler when the JSON has none).

Defaults torchrig adds when the JSON says nothing: ``zero_allow_untested_optimizer: true`` (a
script's torch optimizer is the normal case), ``zero_force_ds_cpu_optimizer`` from
``force_ds_cpu_optimizer`` (false), and no periodic progress printing.

An ``"auto"`` with no source is an error naming the key. Conflicts between concrete values were
reported before launch by the manifest's checks (:mod:`torchrig_deepspeed.config_checks`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from torchrig.plugin import ConfigError

from torchrig_deepspeed.constants import AUTO, DEFAULT_ZERO_STAGE, DS_KEY
from torchrig_deepspeed.ds_json import load_deepspeed_json
from torchrig_deepspeed.options import DeepSpeedPlugin
from torchrig_deepspeed.placeholders import DummyOptim, DummyScheduler

#: steps_per_print when the JSON sets none: DeepSpeed's progress lines would otherwise interleave
#: with the script's output every 10 steps.
QUIET_STEPS_PER_PRINT = 2**62


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() == AUTO


@attrs.define
class EngineConfig:
    """The configuration for one ``deepspeed.initialize`` call, and what was filled provisionally."""

    config: dict[str, Any]
    #: ``train_micro_batch_size_per_gpu`` was ``"auto"`` (or missing) and no dataloader was known:
    #: corrected when one is prepared.
    micro_batch_pending: bool = False
    #: ``gradient_clipping`` is not fixed by any configuration: ``clip_grad_norm_`` may set it.
    clipping_open: bool = False
    #: DeepSpeed builds the JSON's optimizer (the script's one only lent its hyperparameters).
    builds_optimizer: bool = False
    #: DeepSpeed builds and steps the JSON's scheduler.
    builds_scheduler: bool = False
    #: A ``DummyScheduler``'s ``lr_scheduler_callable``: DeepSpeed builds the scheduler with it.
    scheduler_callable: Callable[[Any], Any] | None = None


def _block(ds_json: dict[str, Any], key: str) -> dict[str, Any]:
    value = ds_json.get(key)
    if not isinstance(value, dict):
        value = {}
        ds_json[key] = value
    return value


def _fill(block: dict[str, Any], key: str, value: Any) -> None:
    """Set ``key`` when it is missing or ``"auto"``; a concrete value stays (conflicts were checked)."""
    if value is None:
        if is_auto(block.get(key)):
            del block[key]
        return
    if key not in block or is_auto(block[key]):
        block[key] = value


def micro_batch_of(dataloaders: Sequence[Any], prefer_min: bool) -> int | None:
    """The per-rank batch size of prepared dataloaders (``None`` when none has one)."""
    sizes = []
    for loader in dataloaders:
        total, world = getattr(loader, "total_batch_size", None), getattr(loader, "num_processes", None)
        if isinstance(total, int) and isinstance(world, int) and world > 0 and total % world == 0:
            sizes.append(total // world)
        elif isinstance(getattr(loader, "batch_size", None), int):
            sizes.append(loader.batch_size)
    if not sizes:
        return None
    return min(sizes) if prefer_min else max(sizes)


def _hidden_size(model: Any) -> int | None:
    model_config = getattr(model, "config", None)  # a Hugging Face model's
    if model_config is None:
        return None
    size = getattr(model_config, "hidden_size", None)
    if isinstance(size, int):
        return size
    sizes = getattr(model_config, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) for s in sizes):
        return max(sizes)
    return None


def engine_config(
    options: DeepSpeedPlugin,
    *,
    mixed_precision: str,
    accumulation_steps: int,
    world_size: int,
    micro_batch: int | None,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    split_batches: bool = False,
) -> EngineConfig:
    """The filled DeepSpeed configuration for one model (and its optimizer/scheduler, or None)."""
    source = load_deepspeed_json(options.hf_ds_config).data if options.hf_ds_config is not None else {}
    ds_json: dict[str, Any] = copy.deepcopy(dict(source))
    result = EngineConfig(ds_json)
    problems: list[str] = []

    # -- batch arithmetic ------------------------------------------------------------------------
    ds_json["gradient_accumulation_steps"] = accumulation_steps
    micro = ds_json.get("train_micro_batch_size_per_gpu")
    total = ds_json.get("train_batch_size")
    if micro is None or is_auto(micro):
        if micro_batch is not None:
            ds_json["train_micro_batch_size_per_gpu"] = micro_batch
        elif isinstance(total, int) and not is_auto(total):
            ds_json.pop("train_micro_batch_size_per_gpu", None)  # DeepSpeed derives it from the total
        else:
            ds_json["train_micro_batch_size_per_gpu"] = 1
            result.micro_batch_pending = True
    if total is None or is_auto(total):
        ds_json["train_batch_size"] = ds_json.get("train_micro_batch_size_per_gpu", 1) * accumulation_steps * world_size

    # -- clipping ----------------------------------------------------------------------------------
    clipping = ds_json.get("gradient_clipping")
    if options.gradient_clipping is not None:
        _fill(ds_json, "gradient_clipping", float(options.gradient_clipping))
    elif clipping is None or is_auto(clipping):
        ds_json.pop("gradient_clipping", None)
        result.clipping_open = True

    # -- precision ----------------------------------------------------------------------------------
    for name, aliases in (("fp16", ("fp16",)), ("bf16", ("bf16", "bfloat16"))):
        key = next((a for a in aliases if a in ds_json), aliases[0])
        wanted = mixed_precision == name
        block = ds_json.get(key)
        if block is None:
            if wanted:
                ds_json[key] = {"enabled": True}
            continue
        if isinstance(block, dict):
            if is_auto(block.get("enabled")):
                block["enabled"] = wanted
            for sub, value in list(block.items()):
                if is_auto(value):
                    del block[sub]  # DeepSpeed's default for the loss-scale knobs

    # -- ZeRO ------------------------------------------------------------------------------------------
    zero = _block(ds_json, "zero_optimization")
    stage = options.zero_stage
    if stage is not None:
        _fill(zero, "stage", stage)
    elif "stage" not in zero or is_auto(zero.get("stage")):
        zero["stage"] = DEFAULT_ZERO_STAGE
    for kind in ("optimizer", "param"):
        device = getattr(options, f"offload_{kind}_device")
        path = getattr(options, f"offload_{kind}_nvme_path")
        if device is None and path is None and f"offload_{kind}" not in zero:
            continue
        block = _block(zero, f"offload_{kind}")
        _fill(block, "device", device)
        _fill(block, "nvme_path", path)
        if block.get("device") in (None, "none") and len(block) <= 1:
            del zero[f"offload_{kind}"]
    _fill(zero, "stage3_gather_16bit_weights_on_model_save", bool(options.zero3_save_16bit_model))
    hidden = _hidden_size(model)
    sizes = {"reduce_bucket_size": (lambda h: h * h), "stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h)),
             "stage3_param_persistence_threshold": (lambda h: 10 * h)}
    for key, formula in sizes.items():
        if is_auto(zero.get(key)):
            if hidden is not None:
                zero[key] = formula(hidden)
            else:
                del zero[key]  # DeepSpeed's default: the model declares no hidden size

    # -- defaults torchrig adds ----------------------------------------------------------------------------
    ds_json.setdefault("zero_allow_untested_optimizer", True)
    ds_json.setdefault("zero_force_ds_cpu_optimizer", bool(options.force_ds_cpu_optimizer))
    ds_json.setdefault("steps_per_print", QUIET_STEPS_PER_PRINT)

    # -- optimizer and scheduler blocks ---------------------------------------------------------------------
    hyper = _hyperparameters(optimizer)
    block = ds_json.get("optimizer")
    if isinstance(block, dict):
        result.builds_optimizer = True
        params = block.get("params")
        if isinstance(params, dict):
            for key, value in list(params.items()):
                if not is_auto(value):
                    continue
                if key in hyper:
                    params[key] = hyper[key]
                else:
                    problems.append(_no_source(f"optimizer.params.{key}", optimizer is None, "optimizer"))
    elif isinstance(optimizer, DummyOptim):
        problems.append(
            f"{DS_KEY}: the script passed a DummyOptim, which stands for the optimizer of the DeepSpeed config's "
            "'optimizer' block, but the config has no 'optimizer' block; add one, or pass a torch optimizer")
    block = ds_json.get("scheduler")
    dummy = scheduler if isinstance(scheduler, DummyScheduler) else None
    if isinstance(block, dict):
        result.builds_scheduler = True
        if dummy is not None and dummy.lr_scheduler_callable is not None:
            problems.append(
                f"{DS_KEY}: the DeepSpeed config builds a scheduler ('scheduler' block) and the DummyScheduler's "
                "lr_scheduler_callable would build another; remove one of them")
        elif scheduler is not None and dummy is None:
            problems.append(
                f"{DS_KEY}: the DeepSpeed config builds a scheduler ('scheduler' block) and the script also prepared "
                f"one ({type(scheduler).__name__}); two schedulers would drive one optimizer. Remove the 'scheduler' "
                "block, pass a DummyScheduler in its place, or do not pass the scheduler to prepare()")
        counts: dict[str, Any] = {}
        if dummy is not None:
            counts["warmup_num_steps"] = dummy.warmup_num_steps
            if dummy.total_num_steps is not None:
                counts["total_num_steps"] = (dummy.total_num_steps if split_batches
                                             else math.ceil(dummy.total_num_steps / world_size))
        params = block.get("params")
        if isinstance(params, dict):
            for key, value in list(params.items()):
                if not is_auto(value):
                    continue
                if key.endswith("min_lr"):
                    params[key] = 0.0
                elif key.endswith("max_lr") and "lr" in hyper:
                    params[key] = hyper["lr"]
                elif key in counts:
                    params[key] = counts[key]
                else:
                    problems.append(_no_source(f"scheduler.params.{key}", optimizer is None and key.endswith("max_lr"),
                                               "optimizer"))
    elif dummy is not None:
        if dummy.lr_scheduler_callable is None:
            problems.append(
                f"{DS_KEY}: the script passed a DummyScheduler, which stands for the scheduler of the DeepSpeed "
                "config's 'scheduler' block, but the config has none; add a 'scheduler' block, give the "
                "DummyScheduler an lr_scheduler_callable, or pass a torch scheduler")
        result.scheduler_callable = dummy.lr_scheduler_callable

    leftovers = sorted(_auto_paths(ds_json))
    problems.extend(f"{DS_KEY}: {path!r} is \"auto\" but torchrig has no value to fill it with; set a value in the "
                    "DeepSpeed config" for path in leftovers)
    if problems:
        raise ConfigError(problems, header="the DeepSpeed configuration cannot be completed")
    return result


def _no_source(path: str, missing_object: bool, what: str) -> str:
    if missing_object:
        return (f"{DS_KEY}: {path!r} is \"auto\", filled from the {what} passed to prepare(), but none was passed "
                f"with this model; pass one (e.g. prepare(model, torch.optim.AdamW(model.parameters(), lr=...))) or set "
                "a value in the DeepSpeed config")
    return f"{DS_KEY}: {path!r} is \"auto\" but torchrig has no value to fill it with; set a value in the DeepSpeed config"


def _hyperparameters(optimizer: Any) -> dict[str, Any]:
    """``lr``/``weight_decay``/``betas``/``eps`` of the script's optimizer: a ``DummyOptim``'s own
    values (Accelerate's rule), else its first param group."""
    if optimizer is None or not getattr(optimizer, "param_groups", None):
        return {}
    group = {**optimizer.defaults, **optimizer.kwargs} if isinstance(optimizer, DummyOptim) else optimizer.param_groups[0]
    found: dict[str, Any] = {}
    for key in ("lr", "weight_decay", "betas", "eps", "momentum"):
        if key in group:
            value = group[key]
            value = float(value) if hasattr(value, "item") and not isinstance(value, (list, tuple)) else value
            found[key] = list(value) if isinstance(value, tuple) else value
    return found


def _auto_paths(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, Mapping):
        found = []
        for key, item in value.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            found.extend([path] if is_auto(item) else _auto_paths(item, path))
        return found
    return []


__all__ = ["DEFAULT_ZERO_STAGE", "EngineConfig", "engine_config", "is_auto", "micro_batch_of"]
