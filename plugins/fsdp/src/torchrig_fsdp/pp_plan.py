"""Pipeline stages from a transformers model's own pipeline plan, when the user gives no split.

transformers 5.x models declare ``config.base_model_pp_plan`` (Llama: ``embed_tokens``, ``layers``,
``norm``, in forward order, relative to the base model ``base_model_prefix``) and ``_pp_plan`` on the
head model (``lm_head``). With ``pp_size > 1`` and neither ``pp_split_points`` nor ``pp_split_fn``,
the plan's layer list is split evenly into ``pp_size`` stages: the entries before it on the first
stage, those after it and the head's on the last. A stage is the model with the other stages' layers
deleted (names kept, as :mod:`torchrig_fsdp.pipeline` does) and the other stages' plan entries
replaced by a pass-through function — the base model's forward calls them unconditionally; a function
is no module, so state dicts keep the unsplit model's keys and a tensor-parallel plan's entry for it
(``lm_head``) matches nothing on this stage.

Why a stage module around the model (:class:`PlanStage`): the model's own forward still runs on every
stage (rotary embeddings and the causal mask are computed there from the stage's input), fed the token
ids on the first stage and the previous stage's hidden states as ``inputs_embeds`` on the others —
which is why only the token ids are taken (an ``attention_mask`` would reach the first stage alone),
and why a model whose forward transformed ``inputs_embeds`` outside its plan's entries could not be
split this way. Llama, Qwen3, Gemma (untied), GPT-NeoX and Qwen3-MoE of transformers 5.24 compose
exactly (tested); tied embeddings cannot be split across stages and are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torchrig.plugin import ConfigError, get_logger

logger = get_logger(__name__)

SPLIT_KEY = "parallelism_config.pp_split_points"
_INSTEAD = "give parallelism_config.pp_split_fn (Python) or pp_split_points"


def find_plan(model: torch.nn.Module) -> tuple[str, dict[str, Any], list[str]] | None:
    """``(base prefix, base_model_pp_plan, head entries)`` of a transformers model, or None: the base
    model's plan from its config (its keys relative to ``base_model_prefix`` when ``model`` is a head
    model), and the head model's own ``_pp_plan`` keys (``lm_head``)."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    if not isinstance(plan, dict) or not plan:
        return None
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not isinstance(getattr(model, prefix, None) if prefix else None, torch.nn.Module):
        prefix = ""  # the model is the base model itself
    # an instance's _pp_plan also holds the base model's entries, prefixed: only the head's own are new here
    heads = [key for key in (getattr(model, "_pp_plan", None) or {})
             if prefix and key != prefix and not key.startswith(f"{prefix}.")]
    return prefix, plan, heads


def layer_bounds(layers: int, stages: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each stage's layers: even, the first stages taking one more when uneven."""
    size, extra = divmod(layers, stages)
    bounds, start = [], 0
    for stage in range(stages):
        stop = start + size + (1 if stage < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def _name(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _tied_across(model: torch.nn.Module, owner: dict[str, int]) -> list[str]:
    """Parameters one module shares with a module of another stage (tied embeddings)."""
    holders: dict[int, list[str]] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        holders.setdefault(id(model.get_parameter(name)), []).append(name)
    problems = []
    for names in holders.values():
        stages = {next((s for unit, s in owner.items() if n == unit or n.startswith(unit + ".")), None) for n in names}
        if len(names) > 1 and len(stages) > 1:
            problems.append(f"{SPLIT_KEY}: {' and '.join(names)} are one tied parameter (tie_word_embeddings) but "
                            "the pipeline split from the model's base_model_pp_plan puts them on different stages; "
                            "build the model with tie_word_embeddings=False, or " + _INSTEAD)
    return problems


def split_by_plan(model: torch.nn.Module, stage: int, num_stages: int) -> tuple[torch.nn.Module, PlanStage] | None:
    """``(the rank's module, names kept; its stage module)`` for ``stage``, cut by the model's own
    pipeline plan; None when the model declares none. Refused by name: a plan without exactly one
    layer list, more stages than layers, a parameter outside the plan's entries or tied across stages."""
    found = find_plan(model)
    if found is None:
        return None
    prefix, plan, heads = found
    base = model.get_submodule(prefix) if prefix else model
    cls = type(model).__name__
    lists = [key for key in plan if isinstance(getattr(base, key, None), torch.nn.ModuleList)]
    if len(lists) != 1:
        raise ConfigError([f"{SPLIT_KEY}: {cls}'s base_model_pp_plan ({', '.join(plan)}) has {len(lists)} layer "
                           f"lists (ModuleList entries), not one, so torchrig cannot split it evenly; {_INSTEAD}"])
    (layers_key,) = lists
    layers = getattr(base, layers_key)
    count = len(layers)
    if count < num_stages:
        raise ConfigError([f"parallelism_config.pp_size: pp_size is {num_stages} but {cls} has {count} layers "
                           f"({_name(prefix, layers_key)}), so a stage would be empty (split from its "
                           f"base_model_pp_plan); use a pp_size of at most {count}"])
    position = list(plan).index(layers_key)
    before = [_name(prefix, key) for key in list(plan)[:position]]
    after = [_name(prefix, key) for key in list(plan)[position + 1:]] + heads
    bounds = layer_bounds(count, num_stages)
    layer_names = [_name(prefix, f"{layers_key}.{key}") for key in layers._modules]
    owner = {name: 0 for name in before} | {name: num_stages - 1 for name in after}
    for index, (start, stop) in enumerate(bounds):
        owner.update({name: index for name in layer_names[start:stop]})
    unowned = [name for name, _ in model.named_parameters()
               if not any(name == unit or name.startswith(f"{unit}.") for unit in owner)]
    problems = [f"{SPLIT_KEY}: {cls}'s parameters {', '.join(unowned[:6])}{', ...' if len(unowned) > 6 else ''} are "
                f"in no entry of its base_model_pp_plan, so no stage would own them; {_INSTEAD}"] if unowned else []
    problems += _tied_across(model, owner)
    if problems:
        raise ConfigError(problems)
    described = [", ".join([*(before if index == 0 else []), _span(prefix, layers_key, bounds[index]),
                            *(after if index == num_stages - 1 else [])]) for index in range(num_stages)]
    logger.info(f"pipeline split of {cls} from its base_model_pp_plan (no pp_split_points or pp_split_fn given): "
                + "; ".join(f"stage {index}: {text}" for index, text in enumerate(described)))
    start, stop = bounds[stage]
    for key in [key for i, key in enumerate(list(layers._modules)) if not start <= i < stop]:
        del layers._modules[key]  # the others keep their indices
    for name in (before if stage != 0 else []) + (after if stage != num_stages - 1 else []):
        parent, _, attribute = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        holder._modules.pop(attribute, None)
        # a plain function, not a module: a tensor-parallel plan's 'lm_head' entry matches nothing here,
        # and nothing is saved or sharded for it; the base model's forward still finds and calls it
        object.__setattr__(holder, attribute, _pass_through)
    return model, PlanStage(model, first=stage == 0)


def _pass_through(hidden: Any, *args: Any, **kwargs: Any) -> Any:
    """In place of another stage's plan entry: what it is given (an embedding is never called on a
    later stage, which gets ``inputs_embeds``)."""
    return hidden


def _span(prefix: str, layers_key: str, bounds: tuple[int, int]) -> str:
    """``model.layers.0-1`` (or ``model.layers.2`` for one layer): a stage's layers, for the log."""
    start, stop = bounds
    return _name(prefix, f"{layers_key}.{start}" if stop - start == 1 else f"{layers_key}.{start}-{stop - 1}")


class PlanStage(torch.nn.Module):
    """One pipeline stage of a model split by its own plan: calls the model (registered as ``model``,
    so ``fully_shard`` of the stage covers it) with the token ids on the first stage and the previous
    stage's hidden states as ``inputs_embeds`` on the others, and returns a tensor: the hidden
    states, or the logits on the last stage (its ``lm_head`` is the model's; on the others an identity)."""

    def __init__(self, model: torch.nn.Module, first: bool) -> None:
        super().__init__()
        self.model = model
        self.first = first

    def forward(self, inputs: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
        if inputs is None and self.first and "input_ids" in kwargs:  # model(input_ids=..., target=...)
            inputs = kwargs.pop("input_ids")
        if kwargs or inputs is None:
            given = (f"{', '.join(kwargs)} would reach the first stage only (nothing but the hidden states is passed "
                     "between stages)" if kwargs else "no token ids were given")
            raise ValueError(f"a transformers model pipelined from its base_model_pp_plan takes the token ids alone: "
                             f"{given}; call model(input_ids, target=labels), or split with "
                             "parallelism_config.pp_split_fn")
        key = "input_ids" if self.first else "inputs_embeds"
        output = self.model(**{key: inputs, "use_cache": False})
        for field in ("logits", "last_hidden_state"):
            value = getattr(output, field, None)
            if isinstance(value, torch.Tensor):
                return value
        return output[0] if isinstance(output, (tuple, list)) else output


__all__ = ["PlanStage", "find_plan", "layer_bounds", "split_by_plan"]
