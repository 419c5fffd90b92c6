"""``torchrig merge-weights CKPT OUT``, contributed through the ``torchrig.commands`` entry point.

Torch-free: ``torchrig --help`` imports this module to list the command; the work is done by
:mod:`torchrig_fsdp.merge`, imported only when the command runs.
"""

from __future__ import annotations

import argparse


class MergeWeightsCommand:
    """A ``torchrig`` subcommand: ``help``, ``add_arguments(parser)``, ``run(args) -> exit code``."""

    help = "turn an fsdp checkpoint (sharded or full) into full-weight safetensors files"
    description = (
        "Reads the model state of an fsdp checkpoint written by save_state — SHARDED_STATE_DICT "
        "(torch.distributed.checkpoint directories pytorch_model_fsdp_<i>/, from any number of processes) or "
        "FULL_STATE_DICT (pytorch_model_fsdp.bin) — in this one process, without a process group, and writes "
        "model.safetensors (model_<i>.safetensors for the i-th prepared model) into OUT. The files load into the "
        "plain, unwrapped model with safetensors.torch.load_file and load_state_dict."
    )

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.description = self.description
        parser.add_argument("checkpoint", metavar="CKPT",
                            help="a checkpoint directory (or one pytorch_model_fsdp_<i>/ directory inside it)")
        parser.add_argument("output", metavar="OUT", help="directory to write the safetensors files into")
        parser.add_argument("--overwrite", action="store_true", help="replace safetensors files already in OUT")

    def run(self, args: argparse.Namespace) -> int:
        from torchrig_fsdp.merge import merge_weights

        for path in merge_weights(args.checkpoint, args.output, overwrite=args.overwrite):
            print(path)
        return 0


MERGE_WEIGHTS = MergeWeightsCommand()

__all__ = ["MERGE_WEIGHTS", "MergeWeightsCommand"]
