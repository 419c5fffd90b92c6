"""``torchrig plan MODEL`` / ``torchrig plan train.py ARGS``: check and predict a run at its target
scale from one CPU process.

The configuration is resolved as ``torchrig launch`` resolves it (config file, ``TORCHRIG_*``
variables, the same flags) and handed to each planned rank by the variables a launched worker
gets, so ``torchrig plan MODEL --num_machines 32 --num_processes 256 --config_file fsdp_tp.yaml``
plans exactly what that launch would run (:mod:`torchrig.estimate.plan`); a script is run up to its
``accelerator.prepare`` (:mod:`torchrig.estimate.script_run`). ``--help`` imports no torch. Exit 0
when every planned rank prepares and steps, 1 when the planned run would fail (the errors are
listed), 2 on a usage, configuration or MODEL problem. ``torchrig launch --plan-only`` is the same
plan from a launch command line (:mod:`torchrig.launch.cli`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from torchrig.cli.command_line import CommandParser
from torchrig.config.flags import add_config_flags, collect_flags, flag_values
from torchrig.config.readers import CONFIG_FILE_ENV
from torchrig.config.resolve import Schema, resolve_config
from torchrig.estimate.plan_command import add_plan_arguments, listing, run_and_report
from torchrig.host.plugin_host import PluginHost
from torchrig.launch.cli import split_argv

PROG = "torchrig plan"
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
directory holding one), a transformers model name whose config is in the local cache (offline), or
a training script `train.py ARGS...` (flags before it, its own arguments after it, as for `torchrig
launch`): the script runs up to its first accelerator.prepare of a model, its parameters on the
meta device, and what it prepared is planned. `torchrig launch --plan-only` plans a launch command.
The target is --num_machines and --num_processes (all processes, as for `torchrig launch`; default
8 per machine). Exit 0: the run plans cleanly; 1: the planned run would fail (errors listed, memory
over the GPU's included); 2: a usage, configuration or MODEL problem."""


def build_parser(host: PluginHost) -> tuple[argparse.ArgumentParser, dict[str, Any]]:
    parser = CommandParser(prog=PROG, allow_abbrev=False, description=DESCRIPTION,
                           usage=f"{PROG} [flags] MODEL [flags] | {PROG} [flags] train.py [args...]",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", metavar="MODEL", help="module:function, a config.json (or its directory), "
                                                       "a cached transformers model name, or a script train.py")
    own = parser.add_argument_group("plan")
    add_plan_arguments(own)
    own.add_argument("--config_file", help=f"the run's config file (default: ${CONFIG_FILE_ENV}, then the "
                                           "machine's default file)")
    by_dest = add_config_flags(parser, collect_flags(Schema(host)), "configuration (as for torchrig launch)")
    return parser, by_dest


def _split(parser: argparse.ArgumentParser, argv: Sequence[str]) -> tuple[list[str], list[str] | None]:
    """``(argv for the parser, [script, *its args])`` when MODEL is a script (every word after it is
    the script's), else ``(argv, None)``: a MODEL's flags may come before or after it."""
    if any(token in ("-h", "--help") for token in argv):
        return list(argv), None
    flags, command = split_argv(parser, argv)
    if command and command[0].endswith(".py"):
        return [*flags, command[0]], command
    return list(argv), None


def run_plan(argv: Sequence[str], *, stdout: Any = None) -> int:
    stdout = stdout or sys.stdout
    host = PluginHost()
    parser, by_dest = build_parser(host)
    tokens, script = _split(parser, argv)
    args = parser.parse_args(tokens)
    names = listing(args)
    if names is not None:
        stdout.write(names)
        return 0
    flags = flag_values(args, by_dest)
    # machine 0's address means nothing to a plan (nothing connects), but a multi-machine run needs one
    flags.setdefault("main_process_ip", ("127.0.0.1", "torchrig plan (no machine is contacted)"))
    config = resolve_config(host, config_file=args.config_file, flags=flags, default_file=True, warn=False)
    return run_and_report(args, config, flags, model=args.model, script=script, stdout=stdout)


__all__ = ["DESCRIPTION", "PROG", "build_parser", "run_plan"]
