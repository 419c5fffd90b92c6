"""One torchft replica group for plugins/ft/tests/test_ft.py: a tiny MLP trained with
``Accelerator(strategy="ft")`` until torchft's committed step reaches the number in the stop file.

Prints one JSON line per loop iteration (committed step, replica groups in the quorum, a digest of
the parameters), writes the final parameters to ``<out>/params-<replica>.pt`` and saves a checkpoint
in ``<out>/checkpoint-<replica>``.
Arguments: replica index, output directory. The lighthouse comes from ``TORCHRIG_FT_CONFIG__*``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch
from torchrig import Accelerator

MAX_ITERATIONS = 3000  # a bound, should the stop file never come


def digest(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]


def stop_at(out: str) -> int | None:
    try:
        with open(os.path.join(out, "stop_at")) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return None


def main() -> None:
    replica, out = int(sys.argv[1]), sys.argv[2]
    accelerator = Accelerator(strategy="ft", cpu=True)
    torch.manual_seed(replica)  # groups start different: init_sync gives them one group's parameters
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    manager = model.torchft_manager
    data = torch.Generator().manual_seed(1000 + replica)
    for iteration in range(MAX_ITERATIONS):
        target = stop_at(out)
        if target is not None and manager.current_step() >= target:
            break
        x = torch.randn(8, 16, generator=data)
        loss = (model(x) - x[:, :1]).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        print(json.dumps({"time": time.time(), "pid": os.getpid(), "iteration": iteration, "step": manager.current_step(),
                          "participants": manager.num_participants(),
                          "skipped": accelerator.optimizer_step_was_skipped, "digest": digest(model)}), flush=True)
        time.sleep(0.05)
    torch.save({k: v.detach().cpu() for k, v in accelerator.unwrap_model(model).state_dict().items()},
               os.path.join(out, f"params-{replica}.pt"))
    accelerator.save_state(os.path.join(out, f"checkpoint-{replica}"))  # torchft's step counter goes in it
    accelerator.end_training()
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    main()
