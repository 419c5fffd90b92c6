"""A training script that saves every step and resumes from the latest committed checkpoint.

Dropout (global torch RNG), a shuffled sampler, numpy and python randomness in the loss, a step
scheduler and AdamW make every piece of state matter: a resume that restores anything less than
all of it diverges. Each rank appends ``{"step", "loss", "samples"}`` lines to
``<project>/log-rank<r>.jsonl``; rank 0 writes the final parameters and optimizer state to
``<project>/final.pt``.

    python resumable_train.py PROJECT --steps 12 [--kill-after K] [--async-save] [--total-limit 2]
"""

import argparse
import json
import os
import random
import signal

import numpy as np
import torch
from torchrig import Accelerator
from torchrig.config.options import ProjectConfiguration
from torchrig.testing.runs import StepCounter


class Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return i, torch.randn(6, generator=g), torch.tensor(i % 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--total-limit", type=int, default=2)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=args.project, automatic_checkpoint_naming=True, total_limit=args.total_limit,
        async_save=args.async_save))
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=4, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    progress = StepCounter()
    accelerator.register_for_checkpointing(progress)
    if accelerator.latest_checkpoint() is not None:
        accelerator.load_state()

    log = open(os.path.join(args.project, f"log-rank{accelerator.process_index}.jsonl"), "a")
    while progress.step < args.steps:
        for ids, x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss = loss * (1 + 0.01 * random.random()) * (1 + 0.01 * float(np.random.rand()))
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            progress.step += 1
            log.write(json.dumps({"step": progress.step, "loss": loss.item().hex(), "samples": ids.tolist()}) + "\n")
            log.flush()
            accelerator.save_state()
            if args.kill_after == progress.step:
                accelerator.wait_for_everyone()
                os.kill(os.getpid(), signal.SIGKILL)
            if progress.step >= args.steps:
                break
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {"params": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
                 "optimizer": optimizer.state_dict(), "iteration": accelerator.save_iteration}
        torch.save(state, os.path.join(args.project, "final.pt"))


if __name__ == "__main__":
    main()
