"""What ``torchrig plan`` and ``torchrig launch --plan-only`` share: the plan's own flags, the target
read from the resolved configuration, and the run of the plan with its report and exit code (0 the
run plans cleanly, 1 it would fail). Torch-free to import (``--help`` and usage errors import no
torch); the engine (:mod:`torchrig.estimate.plan`) is imported when a plan runs.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from torchrig.config.readers import CONFIG_FILE_ENV, LAUNCH_OVERRIDES_ENV, encode_launch_overrides
from torchrig.errors import TorchrigError
from torchrig.estimate.hardware import GPUS, INTERCONNECTS, gpu_spec, interconnect
from torchrig.estimate.plan_report import failures, format_plan, plan_as_dict

#: The target when none is named: the GPU and network most large runs of 2026 use.
DEFAULT_GPU = "h100-sxm"
DEFAULT_INTERCONNECT = "ib-ndr-400"
#: GPUs per machine when neither --num_processes nor the configuration says (an 8-GPU server).
DEFAULT_PROCESSES_PER_MACHINE = 8
#: The plan's own flags (their destinations), beside the launch's configuration flags.
PLAN_FLAGS = ("batch_size", "seq_len", "optimizer", "gpu", "interconnect", "ranks", "json")
_OPTIMIZERS = ("adamw", "adam", "sgd", "sgd_momentum", "adagrad", "rmsprop")  # estimate.plan.PLAN_OPTIMIZERS


class PlanUsageError(TorchrigError):
    """A target the configuration cannot describe: one line, exit 2."""


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ranks") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give ranks as 0,128,255 (non-negative)")
    return ranks


def add_plan_arguments(group: Any, *, defaults: bool = True) -> None:
    """The plan's flags on ``group`` (an argparse parser or group). ``defaults=False`` leaves them
    ``None`` when not given, so a command where they are optional (``launch --plan-only``) can tell
    them apart from its own run."""
    default = (lambda value: value) if defaults else (lambda value: None)
    group.add_argument("--batch_size", type=positive_int, default=default(1),
                       help="micro-batch per rank of the planned step (default 1)")
    group.add_argument("--seq_len", type=positive_int, default=default(2048),
                       help="sequence length of the planned step (default 2048)")
    group.add_argument("--optimizer", choices=_OPTIMIZERS, default=default("adamw"),
                       help="the optimizer of the planned step, unless a script prepares its own (default adamw)")
    group.add_argument("--gpu", default=default(DEFAULT_GPU),
                       help=f"GPU kind of the target (default {DEFAULT_GPU}; `--gpu list` lists the known kinds)")
    group.add_argument("--interconnect", default=default(DEFAULT_INTERCONNECT),
                       help=f"network between machines (default {DEFAULT_INTERCONNECT}; `--interconnect list` "
                            "lists them)")
    group.add_argument("--ranks", type=_ranks, help="plan these ranks instead of the representative ones (0,128,255)")
    group.add_argument("--json", action="store_true", default=default(False) if defaults else None,
                       help="machine-readable output")


def given_plan_flags(args: argparse.Namespace) -> list[str]:
    """The plan flags given on the command line (``add_plan_arguments(defaults=False)``)."""
    return [f"--{name}" for name in PLAN_FLAGS if getattr(args, name, None) not in (None, False)]


def listing(args: argparse.Namespace) -> str | None:
    """``--gpu list`` / ``--interconnect list``: the names to print instead of a plan."""
    if args.gpu == "list" or args.interconnect == "list":
        return "\n".join(sorted(GPUS if args.gpu == "list" else INTERCONNECTS)) + "\n"
    return None


def target_of(config: Any) -> tuple[int, int]:
    """(machines, processes per machine) of the configuration: ``num_processes`` counts all
    processes, as for ``torchrig launch``; 8 per machine when unset."""
    machines = int(config["num_machines"])
    total = config.get("num_processes")
    if total is None:
        return machines, DEFAULT_PROCESSES_PER_MACHINE
    total = int(total)
    if total % machines:
        raise PlanUsageError(f"num_processes {total} ({config.source('num_processes')}) is not a multiple of "
                             f"num_machines {machines}: each machine runs num_processes / num_machines ranks")
    return machines, total // machines


def run_and_report(args: argparse.Namespace, config: Any, flags: Mapping[str, Any], *, model: str,
                   script: Sequence[str] | None = None, module: bool = False, stdout: TextIO) -> int:
    """Plan ``model`` (or ``script`` = [path, *args], run up to its prepare) on the target of ``config``,
    each rank given the launch's flag layer and config file as a launched worker is; print the report
    (``args.json``: as JSON). 1 when the planned run would fail or not fit, else 0."""
    gpu = gpu_spec(args.gpu or DEFAULT_GPU)
    network = interconnect(args.interconnect or DEFAULT_INTERCONNECT)
    machines, per_machine = target_of(config)
    environment = {LAUNCH_OVERRIDES_ENV: encode_launch_overrides(dict(flags))}
    if getattr(args, "config_file", None):
        environment[CONFIG_FILE_ENV] = os.path.abspath(args.config_file)
    # torch from here on (the engine); --help and usage errors never get this far
    from torchrig.estimate.plan import PlanInputs, PlanTarget, ScriptTarget, plan_run, recorded_step

    target = ScriptTarget(script[0], tuple(script[1:]), module=module) if script else None
    inputs = PlanInputs(model=model, batch_size=args.batch_size or 1, seq_len=args.seq_len or 2048,
                        optimizer=args.optimizer or "adamw", environment=environment, ranks=args.ranks, script=target)
    report = plan_run(inputs, PlanTarget(machines, per_machine), recorded_step)
    if args.json:
        json.dump(plan_as_dict(report, gpu, network), stdout, indent=2)
        stdout.write("\n")
    else:
        stdout.write(format_plan(report, gpu, network))
    return 1 if failures(report, gpu) else 0


__all__ = ["DEFAULT_GPU", "DEFAULT_INTERCONNECT", "DEFAULT_PROCESSES_PER_MACHINE", "PLAN_FLAGS", "PlanUsageError",
           "add_plan_arguments", "given_plan_flags", "listing", "positive_int", "run_and_report", "target_of"]
