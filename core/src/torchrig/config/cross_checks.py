"""Checks between keys and sections once values are merged, and the selected plugins' own checks.

A value can be valid on its own and wrong beside another (``machine_rank`` past ``num_machines``,
two accumulation counts, ``use_cpu`` with a GPU device); these checks read the merged values, so
they live apart from reading and merging, beside the validation hooks of the plugins the
configuration selects.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from torchrig.config.readers import location_of
from torchrig.config.resolved import ResolvedConfig
from torchrig.config.schema import Problem
from torchrig.config.sections import Schema
from torchrig.config.sources import Entry, Layer
from torchrig.host.plugin_host import PluginHost
from torchrig.plugin.types import ConfigProblem


def cross_section_problems(values: Mapping[str, Any], winners: Mapping[str, Entry], problems: list[Problem]) -> None:
    def where(key: str) -> str | None:
        return location_of(winners[key].source) if key in winners else None

    if not all(isinstance(values.get(k), int) and values[k] >= 0 for k in ("machine_rank", "num_machines")):
        return  # already reported as a bad value
    if values.get("machine_rank", 0) >= values.get("num_machines", 1):
        problems.append(Problem("machine_rank", f"{values['machine_rank']} must be below num_machines "
                                                f"({values['num_machines']}): ranks count from 0", where("machine_rank")))
    processes, machines = values.get("num_processes"), values.get("num_machines", 1)
    if processes is not None and processes < machines:
        problems.append(Problem("num_processes", f"{processes} is fewer than num_machines ({machines}); "
                                                 "num_processes counts processes on all machines", where("num_processes")))
    if machines > 1 and not (values.get("main_process_ip") or values.get("rdzv_endpoint")):
        problems.append(Problem("main_process_ip", f"must be set when num_machines is {machines} (the address of "
                                                   "machine 0), or set rdzv_endpoint", where("num_machines")))
    steps, plugin_steps = values.get("gradient_accumulation_steps"), values.get("gradient_accumulation_plugin.num_steps")
    if (plugin_steps is not None and steps not in (None, 1) and plugin_steps != steps
            and winners["gradient_accumulation_steps"].source.layer is not Layer.DEFAULT):
        problems.append(Problem("gradient_accumulation_steps", (
            f"{steps} disagrees with gradient_accumulation_plugin.num_steps = {plugin_steps} "
            f"({winners['gradient_accumulation_plugin.num_steps'].source}); set one of them"), where("gradient_accumulation_steps")))
    if values.get("use_cpu") and values.get("device") not in (None, "cpu"):
        problems.append(Problem("device", f"{values['device']!r} contradicts use_cpu: true", where("device")))
    if values.get("use_cpu") and values.get("gpu_ids") not in (None, "all"):  # 'all': what Accelerate's files say
        problems.append(Problem("gpu_ids", f"{values['gpu_ids']!r} has no effect with use_cpu: true (no GPU is used); "
                                "remove gpu_ids, or use_cpu to train on those GPUs", where("gpu_ids")))


def declared_axes(schema: Schema) -> dict[str, tuple[str, ...]]:
    """``parallelism_config`` axes each installed strategy's manifest declares."""
    return {info.name: tuple(info.manifest.parallelism_axes) for info in schema.host.plugins("strategy")
            if info.manifest is not None}


def declared_tp_styles(schema: Schema) -> dict[str, tuple[str, ...]]:
    """``tp_plan`` style names each installed strategy's manifest declares."""
    return {info.name: tuple(info.manifest.tp_styles) for info in schema.host.plugins("strategy")
            if info.manifest is not None}


def selected_plugin_keys(config: ResolvedConfig) -> list[str]:
    """``kind:name`` of every plugin the configuration selects explicitly."""
    keys = [f"strategy:{config['strategy']}", f"precision:{config['mixed_precision']}"]
    keys += [f"tracker:{name}" for name in config["log_with"] if isinstance(name, str) and name != "all"]
    for option, kind in (("device", "device"), ("cluster", "cluster")):
        if config.get(option):
            keys.append(f"{kind}:{config[option]}")
    if config.get("use_cpu"):
        keys.append("device:cpu")
    return keys


def plugin_validation_problems(host: PluginHost, config: ResolvedConfig) -> list[str]:
    """``torchrig_validate_config`` on the manifests of the selected plugins; problems found."""
    wanted = {f"{key}#manifest" for key in selected_plugin_keys(config)}
    problems: list[str] = []
    for owner, call in host.iter_impls("torchrig_validate_config", config=config):
        if owner not in wanted:
            continue
        for problem in call() or ():
            if isinstance(problem, ConfigProblem) and problem.where is None and problem.key in config.sources:
                source = config.sources[problem.key]
                problem = attrs.evolve(problem, where=location_of(source))
            problems.append(str(problem))
    return problems
