"""A job that commits ``checkpoint_0``, then pauses in the middle of saving ``checkpoint_1`` — its
temporary directory exists and a save pre-hook has written a file into it — until the test lets it
go on. Meanwhile another process (an evaluator, a second job) reads or writes the same folder.

    python blocking_writer.py PROJECT [--total-limit N]

Writes ``PROJECT/paused`` (holding the temporary directory's path) when it pauses, waits for
``PROJECT/go``, and at the end ``PROJECT/saved.pt`` (the parameters of ``checkpoint_1``).
"""

import argparse
import os
import time

import torch
from torchrig import Accelerator
from torchrig.config.options import ProjectConfiguration

HOOK_FILE = "hook_notes.txt"
PAUSE_LIMIT_S = 120


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project")
    parser.add_argument("--total-limit", type=int, default=None)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=args.project, automatic_checkpoint_naming=True, total_limit=args.total_limit))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerator.save_state()  # checkpoint_0

    def pause(models, weights, output_dir):
        with open(os.path.join(output_dir, HOOK_FILE), "w") as handle:
            handle.write("written by a save pre-hook\n")
        with open(os.path.join(args.project, "paused"), "w") as handle:
            handle.write(output_dir)
        deadline = time.monotonic() + PAUSE_LIMIT_S
        while not os.path.exists(os.path.join(args.project, "go")):
            if time.monotonic() > deadline:
                raise SystemExit("blocking_writer: nobody said go")
            time.sleep(0.02)

    accelerator.register_save_state_pre_hook(pause)
    accelerator.backward(model(torch.randn(2, 8)).sum())
    optimizer.step()
    directory = accelerator.save_state()  # checkpoint_1, paused halfway
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(args.project, "saved.pt"))
    print("committed", directory, flush=True)


if __name__ == "__main__":
    main()
