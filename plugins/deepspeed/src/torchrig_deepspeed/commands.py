"""``torchrig build-deepspeed-ops [OP ...]``, contributed through the ``torchrig.commands`` entry point.

Why: DeepSpeed JIT-compiles some ops on first use, inside ``deepspeed.initialize`` on every rank of
the first job (on CPU its shared-memory comm op, minutes on a loaded machine), and a compile killed
there leaves a lock every later run waits on. Building them once, ahead of the job, in one process,
with a word about what and where, avoids both. Torch-free: ``torchrig --help`` imports this module;
the work is :func:`torchrig_deepspeed.jit_ops.build_ops`, imported when the command runs.
"""

from __future__ import annotations

import argparse
import os
import sys


class BuildOpsCommand:
    """A ``torchrig`` subcommand: ``help``, ``add_arguments(parser)``, ``run(args) -> exit code``."""

    help = "compile DeepSpeed's JIT ops ahead of a job (on CPU: its shared-memory comm op)"
    description = (
        "Compiles, in this one process, the DeepSpeed ops that a run on this machine would compile at its start "
        "(DeepSpeed's CPU accelerator: deepspeed_shm_comm), or the ops named, into torch's extensions directory "
        "($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions/py<version>_<cpu|cuXYZ>), where every later run "
        "finds them. Ops built already are skipped. A lock left by a killed compile is reported, naming the file, "
        "instead of waited on. Exit 0 when everything asked for is built, 1 when something cannot be built now, "
        "2 for an unknown op name."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.description = self.description
        parser.add_argument("ops", nargs="*", metavar="OP",
                            help="DeepSpeed op names as `ds_report` lists them (e.g. cpu_adam); default: the ones a run "
                                 "here compiles at start")
        parser.add_argument("--extensions_dir", "--extensions-dir", metavar="DIR", default=None,
                            help="build into DIR (sets TORCH_EXTENSIONS_DIR for this build: export the same for the runs)")
        parser.add_argument("--stale_lock_seconds", "--stale-lock-seconds", type=float, default=60.0, metavar="S",
                            help="a lock whose build directory has not changed for S seconds is a killed compile's "
                                 "(default 60)")

    def run(self, args: argparse.Namespace) -> int:
        if args.extensions_dir:
            os.environ["TORCH_EXTENSIONS_DIR"] = os.path.abspath(args.extensions_dir)
        import torch

        if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"  # as a run's strategy chooses it on this machine
        import deepspeed

        from torchrig_deepspeed.jit_ops import BuildError, build_ops

        try:
            build_ops(deepspeed, list(args.ops), args.stale_lock_seconds)
        except BuildError as exc:
            print(f"torchrig build-deepspeed-ops: {exc}", file=sys.stderr)
            return exc.code
        return 0


BUILD_OPS = BuildOpsCommand()

__all__ = ["BUILD_OPS", "BuildOpsCommand"]
