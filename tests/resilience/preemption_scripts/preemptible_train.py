"""A training loop that never mentions preemption: configured from outside
(``TORCHRIG_PREEMPTION__SIGNALS``), it must stop with a committed checkpoint and resume exactly.

Dropout, a shuffled prepared loader, python/numpy randomness in the loss, a scheduler and AdamW
make every piece of state matter. Each rank appends ``{"step", "loss", "samples"}`` lines to
``<project>/log-rank<r>.jsonl`` (``"step"`` counts micro-steps); rank 0 writes the final parameters to ``<project>/final.pt``.

    python preemptible_train.py PROJECT --steps 30 [--delay 0.02] [--signal-self-at K]
        [--signal-rank R] [--signal SIGUSR1|SIGTERM] [--accumulate N] [--signal-before-accelerator]
        [--signal-during-save | --signal-during-load] [--save-every N]
"""

import argparse
import json
import os
import random
import signal
import time

import numpy as np
import torch
from torchrig import Accelerator
from torchrig.config.options import ProjectConfiguration


class Progress:
    """The step counter, checkpointed; ``signal_on`` ("save"/"load") makes it send the process a
    signal from inside ``save_state``/``load_state`` (once)."""

    def __init__(self, signal_on: str | None = None, signal_name: str = "SIGUSR1") -> None:
        self.step = 0
        self.signal_on, self.signal_name = signal_on, signal_name

    def _maybe_signal(self, moment: str) -> None:
        if self.signal_on == moment:
            self.signal_on = None
            os.kill(os.getpid(), signal.Signals[self.signal_name])

    def state_dict(self) -> dict:
        self._maybe_signal("save")
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self._maybe_signal("load")
        self.step = int(state["step"])


class Indexed(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return i, torch.randn(6, generator=g), torch.tensor(i % 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("project")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds of 'work' per step")
    parser.add_argument("--signal-self-at", type=int, default=None, help="a rank sends itself a signal after this step")
    parser.add_argument("--signal-rank", type=int, default=0, help="the rank that signals itself")
    parser.add_argument("--signal", default="SIGUSR1", help="the signal it sends itself")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--signal-before-accelerator", action="store_true",
                        help="every rank sends itself the signal before its Accelerator exists")
    parser.add_argument("--signal-during-save", action="store_true", help="the signal arrives inside save_state")
    parser.add_argument("--signal-during-load", action="store_true", help="the signal arrives inside load_state")
    parser.add_argument("--save-every", type=int, default=0, help="save_state every N steps (0: never)")
    args = parser.parse_args()
    if args.signal_before_accelerator:
        os.kill(os.getpid(), signal.Signals[args.signal])

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate, project_config=ProjectConfiguration(
        project_dir=args.project, automatic_checkpoint_naming=True, total_limit=2))
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
    loader = torch.utils.data.DataLoader(Indexed(), batch_size=4, shuffle=True)
    model, optimizer, scheduler, loader = accelerator.prepare(model, optimizer, scheduler, loader)
    progress = Progress("save" if args.signal_during_save else "load" if args.signal_during_load else None,
                        args.signal)
    accelerator.register_for_checkpointing(progress)
    if accelerator.latest_checkpoint() is not None:
        accelerator.load_state()
        print(f"resumed at step {progress.step}", flush=True)

    log = open(os.path.join(args.project, f"log-rank{accelerator.process_index}.jsonl"), "a")
    while progress.step < args.steps:
        for ids, x, y in loader:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss = loss * (1 + 0.01 * random.random()) * (1 + 0.01 * float(np.random.rand()))
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            progress.step += 1
            log.write(json.dumps({"step": progress.step, "loss": loss.item().hex(), "samples": ids.tolist()}) + "\n")
            log.flush()
            time.sleep(args.delay)
            if args.signal_self_at == progress.step and accelerator.process_index == args.signal_rank:
                os.kill(os.getpid(), signal.Signals[args.signal])
            if args.save_every and progress.step % args.save_every == 0:
                accelerator.save_state()
            if progress.step >= args.steps:
                break
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        state = {"params": {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
                 "optimizer": optimizer.state_dict()}
        torch.save(state, os.path.join(args.project, "final.pt"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
