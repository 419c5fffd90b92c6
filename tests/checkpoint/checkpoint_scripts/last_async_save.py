"""A script whose last statement is ``save_state(async_save=True)``: no ``wait_for_everyone``, no
``end_training``. The save must still commit at interpreter exit, or the process must fail loudly.

    python last_async_save.py PROJECT [--fail-rank R]

``--fail-rank R``: on rank R every file write past a few kilobytes fails (a file-size limit, the way
a full disk fails), so the background save fails after the script has returned.
"""

import argparse
import resource
import signal

import torch
from torchrig import Accelerator
from torchrig.config.options import ProjectConfiguration


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project")
    parser.add_argument("--fail-rank", type=int, default=None)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=args.project, automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = torch.nn.Linear(128, 128)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters()))
    accelerator.backward(model(torch.randn(2, 128)).sum())
    optimizer.step()
    if args.fail_rank == accelerator.process_index:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (12_000, resource.RLIM_INFINITY))
    accelerator.save_state(async_save=True)
    print(f"rank {accelerator.process_index}: save_state returned", flush=True)


if __name__ == "__main__":
    main()
