"""A 2-process training run logging to every installed tracker plus one that always fails.

Usage: ``torchrig launch --num_processes 2 --cpu train_tracked.py PROJECT_DIR STEPS``. Each rank
writes ``PROJECT_DIR/result-<rank>.json``: the trackers it ran and its ``end_training`` report.
"""

import json
import os
import sys

import torch
from torchrig import Accelerator, Tracker


class AlwaysFails(Tracker):
    """A tracker whose every call raises, like one whose server is unreachable."""

    name = "always_fails"

    def store_init_configuration(self, values):
        raise ConnectionError("tracking server unreachable")

    def log(self, values, step, **kwargs):
        raise ConnectionError("tracking server unreachable")


def main() -> None:
    project_dir, steps = sys.argv[1], int(sys.argv[2])
    accelerator = Accelerator(log_with=["all", AlwaysFails()], project_dir=project_dir)
    accelerator.init_trackers("demo", config={"lr": 0.05, "steps": steps})
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = accelerator.prepare(model, optimizer)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    for step in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.detach()}, step=step)
    names = [tracker.name for tracker in accelerator.trackers]
    report = accelerator.end_training()
    with open(os.path.join(project_dir, f"result-{accelerator.process_index}.json"), "w") as handle:
        json.dump({"trackers": names, "report": report, "final_loss": loss.item()}, handle)


if __name__ == "__main__":
    main()
