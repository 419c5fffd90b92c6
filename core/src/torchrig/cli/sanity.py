"""``torchrig test``: launch the sanity script (:mod:`torchrig.cli.selftest`) with the current
configuration and say plainly what works on this machine.

It is ``torchrig launch [flags] -m torchrig.cli.selftest``: every launch flag and config source
applies, so ``torchrig test --num_processes 2 --strategy fsdp`` checks exactly what a training
script launched with those flags would get. Torch-free until the launcher starts the workers.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence

from torchrig.host.plugin_host import PluginHost
from torchrig.launch.cli import PROG as LAUNCH_PROG
from torchrig.launch.cli import UsageError, build_parser, run_launch, split_argv

PROG = "torchrig test"
SELFTEST_MODULE = "torchrig.cli.selftest"
DESCRIPTION = f"""\
Run a short sanity training with the current configuration: the Accelerator starts with the
selected plugins, collectives agree across ranks, a tiny model trains and ends identical on every
rank, and a checkpoint round trip replays the next step bit-identically. Takes every
`{LAUNCH_PROG}` flag (shown below) and no script; it runs `{LAUNCH_PROG} [flags] -m
{SELFTEST_MODULE}`. Exit 0 when every check passed on every rank, 1 when one failed (the failing
rank and check are named), 2 on a usage or configuration problem."""


def run_test(argv: Sequence[str]) -> int:
    parser, _ = build_parser(PluginHost())
    if any(token in ("-h", "--help") for token in argv):
        parser.prog, parser.description = PROG, DESCRIPTION
        parser.usage = f"{PROG} [flags]"
        for action in parser._actions:  # what runs is not the user's to choose here
            if action.dest in ("training_script", "training_script_args", "module", "no_python"):
                action.help = argparse.SUPPRESS
        parser.print_help(sys.stdout)
        return 0
    flags, command = split_argv(parser, argv)
    if any(flag.partition("=")[0] in ("-m", "--module", "--no_python") for flag in flags):
        raise UsageError(f"{PROG} chooses what to run; -m/--module and --no_python are not accepted")
    if command:
        raise UsageError(f"{PROG} runs its own sanity script and takes only launch flags; got {command[0]!r} "
                         f"(to run a script: {LAUNCH_PROG} [flags] {command[0]})")
    if any(flag.partition("=")[0] == "--log_dir" for flag in flags):
        return run_launch([*flags, "-m", SELFTEST_MODULE])
    # Logs of a passing sanity run are noise: kept (and named) only when a check failed.
    log_dir = tempfile.mkdtemp(prefix="torchrig-test-logs-")
    code = 1
    try:
        code = run_launch([*flags, "--log_dir", log_dir, "-m", SELFTEST_MODULE])
    finally:  # a usage or configuration error raised before anything ran leaves the directory empty
        if code == 0 or not os.listdir(log_dir):
            shutil.rmtree(log_dir, ignore_errors=True)
    if code != 0:
        # 130/143: stopped by SIGINT/SIGTERM (the launcher's summary above says where each rank was, e.g. a
        # lock it waited on), which is not a failed check
        what = "stopped before its checks finished (see the summary above)" if code in (130, 143) else "a check failed"
        print(f"{PROG}: {what}; the per-rank logs are kept in {log_dir}", file=sys.stderr)
    return code


__all__ = ["DESCRIPTION", "PROG", "run_test"]
