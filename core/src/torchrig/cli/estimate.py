"""``torchrig estimate-memory MODEL``: per-rank training memory under the configured strategy.

The configuration is resolved as ``torchrig launch`` resolves it (config file, ``TORCHRIG_*``
variables, the same flags), so ``torchrig estimate-memory gpt2 --num_processes 8 --use_fsdp
--mixed_precision bf16`` sizes exactly what that launch would run. One model of memory in the
project: a strategy the plan can run is sized by one planned training step at the configured world
size (:mod:`torchrig.estimate.planned_memory`, the engine of ``torchrig plan``); one it cannot
(DeepSpeed) by its manifest's :func:`~torchrig.plugin.hookspecs.torchrig_estimate_memory` on the
model built on the meta device (:mod:`torchrig.estimate.memory_model`), the core's default when it
has none. ``--help`` imports no torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import attrs

from torchrig.cli.command_line import CommandParser, positive_int
from torchrig.config.flags import add_config_flags, collect_flags, flag_values
from torchrig.config.readers import CONFIG_FILE_ENV, LAUNCH_OVERRIDES_ENV, encode_launch_overrides
from torchrig.config.resolve import ResolvedConfig, Schema, resolve_config
from torchrig.errors import TorchrigError
from torchrig.estimate.memory import (
    OPTIMIZERS,
    MemoryEstimate,
    MemoryRequest,
    ModelFootprint,
    format_bytes,
    format_estimate,
)
from torchrig.estimate.planned_memory import recorded_estimate
from torchrig.host.plugin_host import DEFAULTS_NAME, PluginHost
from torchrig.launch.cli import work_out_layout

PROG = "torchrig estimate-memory"
DESCRIPTION = """\
Estimate the memory each rank holds while training MODEL under the configured strategy, precision
and number of processes, at the peak of a training step: parameters, gradients, optimizer state,
activations of one micro-batch and the strategy's buffers, SUMMED. Nothing is allocated: a strategy
the plan can run (one process, DDP, FSDP2 and N-D meshes) is sized by one training step recorded on
fake tensors, the real strategy in a fake world of the configured size (as `torchrig plan`, which
adds communication and step time); DeepSpeed by its own estimate on the model built on the meta device.

MODEL is a Python factory `module:function` returning a torch.nn.Module, a local config.json (or a
directory holding one), or a transformers model name whose config is in the local cache (offline).
The configuration is resolved as `torchrig launch` resolves it; its flags are accepted (below).
Exit 0; 1 when the run would fail at prepare or in its step (the error is named); 2 on a usage,
configuration or MODEL problem."""


def build_parser(host: PluginHost) -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    parser = CommandParser(prog=PROG, allow_abbrev=False, description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL", help="module:function, a config.json (or its directory), "
                                                       "or a cached transformers model name")
    own = parser.add_argument_group("estimate")
    own.add_argument("--batch_size", type=positive_int, default=1, help="micro-batch per rank (default 1)")
    own.add_argument("--seq_len", type=positive_int, default=512, help="sequence length (default 512)")
    own.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                     help="optimizer whose state is counted (default adamw: 8 bytes per element)")
    own.add_argument("--compare", metavar="STRATEGY[,STRATEGY...]",
                     help="estimate under each of these strategies too (default: the configured one only)")
    own.add_argument("--no_activations", action="store_true",
                     help="leave out what depends on the batch (activations, temporaries)")
    own.add_argument("--json", action="store_true", help="machine-readable output")
    own.add_argument("--config_file", help=f"the run's config file (default: ${CONFIG_FILE_ENV}, then the "
                                           "machine's default file)")
    by_dest = add_config_flags(parser, collect_flags(Schema(host)), "configuration (as for torchrig launch)")
    return parser, by_dest


def run_estimate(argv: Sequence[str], *, stdout: Any = None) -> int:
    stdout = stdout or sys.stdout
    host = PluginHost()
    parser, by_dest = build_parser(host)
    args = parser.parse_args(list(argv))
    flags = flag_values(args, by_dest)
    configs = _configurations(host, args, flags)
    recorded = [_planned(args, config, layout, given) for config, layout, given in configs]
    failed = [error for estimate, errors in recorded for error in errors]
    if failed:
        for error in failed:
            print(f"{PROG}: the run would fail: {error}", file=sys.stderr)
        return 1
    needs_analytic = any(estimate is None for estimate, _ in recorded)
    model = _footprint(args, activations=needs_analytic and not args.no_activations)
    estimates = []
    for (config, layout, _), (estimate, _) in zip(configs, recorded):
        if estimate is None:
            optimizer = OPTIMIZERS[args.optimizer]
            estimate = estimate_memory(host, MemoryRequest(
                model=model, world_size=layout.world_size, strategy=config["strategy"],
                precision=config["mixed_precision"], optimizer_bytes_per_element=optimizer[0],
                optimizer_bytes_per_tensor=optimizer[1], config=config))
        estimates.append(estimate)
    if args.json:
        json.dump({"model": _describe_model(model), "optimizer": args.optimizer,
                   "estimates": [e.as_dict() for e in estimates]}, stdout, indent=2)
        stdout.write("\n")
        return 0
    stdout.write(_model_line(model, args.optimizer) + "\n\n")
    for item in estimates:
        stdout.write(format_estimate(item) + "\n\n")
    if len(estimates) > 1:
        stdout.write("totals per rank\n")
        for item in estimates:
            cpu = f" (+ {format_bytes(item.total('cpu'))} CPU)" if item.total("cpu") else ""
            stdout.write(f"  {item.label:<40} {format_bytes(item.total('device')):>12}{cpu}\n")
    return 0


def _planned(args: argparse.Namespace, config: ResolvedConfig, layout: Any,
             given: dict[str, Any]) -> tuple[MemoryEstimate | None, list[str]]:
    """``(estimate, [])`` from one planned step at the configured world size; ``(None, [])`` when
    the strategy cannot be planned (its manifest answers instead); ``(None, errors)`` when the run
    would fail at prepare or in its step (each error names the rank)."""
    from torchrig.estimate.plan import PlanInputs, PlanTarget, plan_run, recorded_step  # torch: not for --help

    environment = {LAUNCH_OVERRIDES_ENV: encode_launch_overrides(given)}
    if args.config_file:
        environment[CONFIG_FILE_ENV] = os.path.abspath(args.config_file)
    inputs = PlanInputs(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                        optimizer=args.optimizer, environment=environment)
    report = plan_run(inputs, PlanTarget(layout.num_machines, layout.nproc_per_node), recorded_step)
    errors = [f"{config['strategy']}, rank {plan.rank}: {plan.error}" for plan in report.ranks if plan.error]
    if errors:
        return None, errors
    return recorded_estimate(report, no_activations=args.no_activations), []


def estimate_memory(host: PluginHost, request: MemoryRequest) -> MemoryEstimate:
    """Ask the manifest of ``request.strategy``, then the core default (never another strategy)."""
    wanted = {f"strategy:{request.strategy}#manifest", DEFAULTS_NAME}
    for owner, call in host.iter_impls("torchrig_estimate_memory", request=request):
        if owner in wanted:
            answer = call()
            if answer is not None:
                return answer
    raise TorchrigError(f"no estimate for strategy {request.strategy!r}")  # the core default always answers


def _configurations(host: PluginHost, args: argparse.Namespace,
                    flags: dict[str, Any]) -> list[tuple[ResolvedConfig, Any, dict[str, Any]]]:
    """The resolved configuration, the launch layout and the flags of each strategy to estimate."""
    strategies: list[str | None] = [None]
    if args.compare:
        strategies += [name.strip() for name in args.compare.split(",") if name.strip()]
    out: list[tuple[ResolvedConfig, Any, dict[str, Any]]] = []
    for strategy in strategies:
        given = dict(flags)
        if strategy is not None:
            given["strategy"] = (strategy, "--compare")
        config = resolve_config(host, config_file=args.config_file, flags=given, default_file=True, warn=False)
        layout = work_out_layout(config)
        if layout.strategy_world and layout.world_size > 1:  # the default strategy depends on the process count
            config = resolve_config(host, config_file=args.config_file, flags=given, default_file=True, warn=False,
                                    world_size=layout.world_size)
            given = {**given, "strategy": (config["strategy"], "the default for this world size")}
        if all(config["strategy"] != done["strategy"] for done, _, _ in out):
            out.append((config, layout, given))
    return out


def _footprint(args: argparse.Namespace, *, activations: bool) -> ModelFootprint:
    """The model's footprint on the meta device; its activations counted only for a strategy the plan
    cannot run (its manifest's estimate reads them)."""
    from torchrig.estimate.memory_model import build_on_meta, footprint, resolve_model  # torch: not for --help

    name, build = resolve_model(args.model)
    model = build_on_meta(build, args.model)
    found = footprint(model, name, batch_size=args.batch_size, seq_len=args.seq_len, activations=activations)
    if not activations and not args.no_activations:  # every estimate's step recorded its own
        found = attrs.evolve(found, activation_note="recorded by each estimate's planned step")
    return found


def _describe_model(model: ModelFootprint) -> dict[str, Any]:
    return {"name": model.name, "parameters": model.numel, "trainable": model.trainable_numel,
            "parameter_bytes": model.parameter_bytes, "buffer_bytes": model.buffer_bytes,
            "by_dtype": model.by_dtype(), "largest_unit": model.unit_name, "largest_unit_parameters": model.unit_parameters,
            "activation_bytes": model.activation_bytes, "activation_note": model.activation_note}


def _model_line(model: ModelFootprint, optimizer: str) -> str:
    dtypes = ", ".join(f"{count:,} {dtype}" for dtype, count in model.by_dtype().items())
    activations = (f"; activations {format_bytes(model.activation_bytes)} ({model.activation_note})"
                   if model.activation_bytes is not None else "")
    return (f"model {model.name}: {model.numel:,} parameters ({dtypes}; {model.trainable_numel:,} trainable), "
            f"{format_bytes(model.parameter_bytes)}; largest block {model.unit_name}: {model.unit_parameters:,}; "
            f"optimizer {optimizer}{activations}")


__all__ = ["DESCRIPTION", "PROG", "build_parser", "estimate_memory", "run_estimate"]
