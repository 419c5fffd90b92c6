"""``Accelerator(...)``'s arguments, translated into configuration arguments (the layer between
the machine's default file and the run's config file; see :mod:`torchrig.config.resolve`).

Accelerate's keyword arguments, options objects and ``kwargs_handlers`` map onto torchrig's
configuration sections here, in one place; an argument torchrig does not support is an error
naming it, never ignored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from torchrig.config.parallelism import parallelism_argument
from torchrig.config.sections import Schema, options_reference
from torchrig.errors import ConfigError

#: Accelerate arguments torchrig does not support, and why (passing one is an error, never ignored).
_UNSUPPORTED_ARGUMENTS = {
    "megatron_lm_plugin": "Megatron-LM is not supported",
    "deepspeed_plugins": "several DeepSpeed configurations per Accelerator are not supported; each prepared model "
    "gets its own engine from the one deepspeed_plugin",
}


def accelerator_arguments(schema: Schema, **kwargs: Any) -> dict[str, Any]:
    """Translate ``Accelerator(...)`` arguments into configuration arguments.

    Options objects (``DataLoaderConfiguration``, ``kwargs_handlers`` items, a plugin's
    ``FullyShardedDataParallelPlugin``...) go to the section whose options class they are; a
    strategy plugin's options object also selects that strategy, as in Accelerate.
    """
    problems: list[str] = []
    arguments: dict[str, Any] = {}
    given_by: dict[str, str] = {}  # section -> the argument that set it: a second one is refused, naming both
    sections_by_type = {options_reference(section.options): key for key, section in schema.sections.items()}

    def put_section_object(obj: Any, where: str, selects_strategy: bool = False) -> None:
        key = sections_by_type.get(options_reference(type(obj)))
        if key is None:
            problems.append(f"{where}: {type(obj).__name__} is not an options class of torchrig or an installed plugin")
            return
        if key in given_by:  # Accelerate refuses two handlers of one kind too; keeping one would drop the other
            problems.append(f"{where}: a second {type(obj).__name__} ({key}); {given_by[key]} already gives one — "
                            "pass one object with every field you want")
            return
        given_by[key] = where
        arguments[key] = obj
        owner = schema.section_owner.get(key, "")
        if selects_strategy and owner.startswith("strategy:"):  # fsdp_plugin=... selects FSDP, as in Accelerate
            arguments.setdefault("strategy", owner.partition(":")[2])

    for name, reason in _UNSUPPORTED_ARGUMENTS.items():
        if kwargs.pop(name, None) is not None:
            problems.append(f"Accelerator({name}=...): {reason}")
    for name in ("mixed_precision", "strategy", "strict_config"):
        if kwargs.get(name) is not None:
            arguments[name] = kwargs.pop(name)
        kwargs.pop(name, None)
    steps = kwargs.pop("gradient_accumulation_steps", 1)
    if steps != 1:
        arguments["gradient_accumulation_steps"] = steps
    if kwargs.pop("cpu", False):
        arguments["use_cpu"] = True
    log_with = kwargs.pop("log_with", None)
    if log_with is not None:
        arguments["log_with"] = list(log_with) if isinstance(log_with, (list, tuple)) else [log_with]
    split_batches = kwargs.pop("split_batches", None)
    mesh, found = parallelism_argument(kwargs.pop("parallelism_config", None), kwargs.pop("torch_tp_plugin", None))
    problems += found
    if mesh is not None:
        arguments["parallelism_config"] = mesh
    for name in ("dataloader_config", "project_config", "gradient_accumulation_plugin", "dynamo_plugin",
                 "deepspeed_plugin", "fsdp_plugin"):
        obj = kwargs.pop(name, None)
        if obj is not None:
            put_section_object(obj, f"Accelerator({name}=...)", selects_strategy=name in ("deepspeed_plugin", "fsdp_plugin"))
    for index, handler in enumerate(kwargs.pop("kwargs_handlers", None) or ()):
        put_section_object(handler, f"Accelerator(kwargs_handlers[{index}])")
    project_dir = kwargs.pop("project_dir", None)
    if project_dir is not None:
        _merge_field(arguments, "project_config", "project_dir", os.fspath(project_dir))
    if split_batches is not None:
        _merge_field(arguments, "dataloader_config", "split_batches", split_batches)
    backend = kwargs.pop("dynamo_backend", None)
    if backend is not None:
        _merge_field(arguments, "dynamo_config", "backend", getattr(backend, "value", backend))
    if kwargs:
        problems.extend(f"Accelerator({name}=...): unknown argument" for name in sorted(kwargs))
    if problems:
        raise ConfigError(problems, header="invalid Accelerator arguments")
    return arguments


def _merge_field(arguments: dict[str, Any], section: str, field: str, value: Any) -> None:
    """Add one field to a section given as an object or a mapping (an object sets all fields)."""
    current = arguments.get(section)
    if current is None:
        arguments[section] = {field: value}
    elif isinstance(current, Mapping):
        arguments[section] = {**current, field: value}
    else:
        arguments[section] = attrs.evolve(current, **{field: value})


__all__ = ["accelerator_arguments"]
