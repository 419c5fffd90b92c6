"""``torchrig plan MODEL``: check and predict a run at its target scale from one CPU process.

The configuration is resolved as ``torchrig launch`` resolves it (config file, ``TORCHRIG_*``
variables, the same flags) and handed to each planned rank by the variables a launched worker
gets, so ``torchrig plan MODEL --num_machines 32 --num_processes 256 --config_file fsdp_tp.yaml``
plans exactly what that launch would run (:mod:`torchrig.estimate.plan`). ``--help`` imports no
torch. Exit 0 when every planned rank prepares and steps, 1 when the planned run would fail (the
errors are listed), 2 on a usage, configuration or MODEL problem.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from torchrig.cli.command_line import CommandParser, UsageError, positive_int
from torchrig.config.flags import add_config_flags, collect_flags, flag_values
from torchrig.config.readers import CONFIG_FILE_ENV, LAUNCH_OVERRIDES_ENV, encode_launch_overrides
from torchrig.config.resolve import Schema, resolve_config
from torchrig.estimate.hardware import GPUS, INTERCONNECTS, gpu_spec, interconnect
from torchrig.estimate.plan_report import failures, format_plan, plan_as_dict
from torchrig.host.plugin_host import PluginHost

PROG = "torchrig plan"
#: The target when none is named: the GPU and network most large runs of 2026 use.
DEFAULT_GPU = "h100-sxm"
DEFAULT_INTERCONNECT = "ib-ndr-400"
#: GPUs per machine when neither --num_processes nor the configuration says (an 8-GPU server).
DEFAULT_PROCESSES_PER_MACHINE = 8
DESCRIPTION = """\
Plan MODEL's training run at its target scale from this one CPU process: every representative rank
(the first rank of the first, a middle and the last pipeline stage) runs the real Accelerator and
strategy in a fake process group of the target size, prepares the model on the meta device and one
training step on fake tensors. Reports each rank's layout, memory at the step's peak, the
collectives per mesh axis with their bytes, and a step-time estimate on the chosen GPU and network
(docs/plan.md says how each number is made and how accurate it was measured to be). Every error
the real run would raise at prepare or in the step is listed, by rank, and so is a step whose peak
does not fit the GPU.

MODEL is a Python factory `module:function` returning a torch.nn.Module, a local config.json (or a
directory holding one), or a transformers model name whose config is in the local cache (offline).
The target is --num_machines and --num_processes (all processes, as for `torchrig launch`; default
8 per machine). Exit 0: the run plans cleanly; 1: the planned run would fail (errors listed, memory
over the GPU's included); 2: a usage, configuration or MODEL problem."""


def _ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ranks") from None
    if not ranks or min(ranks) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give ranks as 0,128,255 (non-negative)")
    return ranks


def build_parser(host: PluginHost) -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    parser = CommandParser(prog=PROG, allow_abbrev=False, description=DESCRIPTION,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL", help="module:function, a config.json (or its directory), "
                                                       "or a cached transformers model name")
    own = parser.add_argument_group("plan")
    own.add_argument("--batch_size", type=positive_int, default=1, help="micro-batch per rank (default 1)")
    own.add_argument("--seq_len", type=positive_int, default=2048, help="sequence length (default 2048)")
    own.add_argument("--optimizer", choices=("adamw", "adam", "sgd", "sgd_momentum"), default="adamw",
                     help="the optimizer of the planned step (default adamw)")
    own.add_argument("--gpu", default=DEFAULT_GPU, help=f"GPU kind of the target (default {DEFAULT_GPU}; "
                                                        "`--gpu list` lists the known kinds)")
    own.add_argument("--interconnect", default=DEFAULT_INTERCONNECT,
                     help=f"network between machines (default {DEFAULT_INTERCONNECT}; `--interconnect list` lists them)")
    own.add_argument("--ranks", type=_ranks, help="plan these ranks instead of the representative ones (0,128,255)")
    own.add_argument("--json", action="store_true", help="machine-readable output")
    own.add_argument("--config_file", help=f"the run's config file (default: ${CONFIG_FILE_ENV}, then the "
                                           "machine's default file)")
    by_dest = add_config_flags(parser, collect_flags(Schema(host)), "configuration (as for torchrig launch)")
    return parser, by_dest


def target_of(config: Any) -> tuple[int, int]:
    """(machines, processes per machine) of the configuration: ``num_processes`` counts all
    processes, as for ``torchrig launch``."""
    machines = int(config["num_machines"])
    total = config.get("num_processes")
    if total is None:
        return machines, DEFAULT_PROCESSES_PER_MACHINE
    total = int(total)
    if total % machines:
        raise UsageError(f"num_processes {total} ({config.source('num_processes')}) is not a multiple of "
                         f"num_machines {machines}: each machine runs num_processes / num_machines ranks")
    return machines, total // machines


def run_plan(argv: Sequence[str], *, stdout: Any = None) -> int:
    stdout = stdout or sys.stdout
    host = PluginHost()
    parser, by_dest = build_parser(host)
    args = parser.parse_args(list(argv))
    if args.gpu == "list" or args.interconnect == "list":
        stdout.write("\n".join(sorted(GPUS if args.gpu == "list" else INTERCONNECTS)) + "\n")
        return 0
    gpu = gpu_spec(args.gpu)
    network = interconnect(args.interconnect)
    flags = flag_values(args, by_dest)
    # machine 0's address means nothing to a plan (nothing connects), but a multi-machine run needs one
    flags.setdefault("main_process_ip", ("127.0.0.1", "torchrig plan (no machine is contacted)"))
    config = resolve_config(host, config_file=args.config_file, flags=flags, default_file=True, warn=False)
    machines, per_machine = target_of(config)
    environment = {LAUNCH_OVERRIDES_ENV: encode_launch_overrides(flags)}
    if args.config_file:
        environment[CONFIG_FILE_ENV] = os.path.abspath(args.config_file)
    # torch from here on (the engine); --help and usage errors never get this far
    from torchrig.estimate.plan import PlanInputs, PlanTarget, plan_run, recorded_step

    report = plan_run(PlanInputs(model=args.model, batch_size=args.batch_size, seq_len=args.seq_len,
                                 optimizer=args.optimizer, environment=environment, ranks=args.ranks),
                      PlanTarget(machines, per_machine), recorded_step)
    if args.json:
        json.dump(plan_as_dict(report, gpu, network), stdout, indent=2)
        stdout.write("\n")
    else:
        stdout.write(format_plan(report, gpu, network))
    return 1 if failures(report, gpu) else 0


__all__ = ["DESCRIPTION", "PROG", "build_parser", "run_plan", "target_of"]
