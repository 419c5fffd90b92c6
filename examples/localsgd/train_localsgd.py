"""Train a small classifier with local SGD — the example of the torchrig-localsgd plugin.

The script is an ordinary torchrig loop; the strategy comes from the launch:

    torchrig launch --num_processes 2 --strategy localsgd --localsgd_sync_every 4 examples/localsgd/train_localsgd.py

or from a config file (``strategy: localsgd`` and ``localsgd_config: {sync_every: 4}``). Each rank
trains on its own shard; every K optimizer steps the ranks' parameters are averaged. At the end
the ranks are averaged once more (``get_state_dict``: the exported model) and the script reports
the loss of that model on the whole data set before and after training.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchrig import Accelerator
from torchrig.utils import set_seed


def make_data(n: int) -> TensorDataset:
    """Three classes decided by a fixed random projection of 16 features."""
    features = torch.randn(n, 16, generator=torch.Generator().manual_seed(0))
    labels = (features @ torch.randn(16, 3, generator=torch.Generator().manual_seed(1))).argmax(dim=1)
    return TensorDataset(features, labels)


def full_loss(model: nn.Module, state: dict, data: TensorDataset) -> float:
    model.load_state_dict(state)
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(data.tensors[0]), data.tensors[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(0)
    data = make_data(2048)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loader = DataLoader(data, batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    probe = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
    first = full_loss(probe, accelerator.get_state_dict(model), data)

    sync_every = accelerator.config.get("localsgd_config.sync_every")
    accelerator.print(f"strategy {accelerator.strategy}, {accelerator.num_processes} processes, "
                      f"parameters averaged every {sync_every} steps")
    step = 0
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step % 50 == 0:
                accelerator.print(f"step {step}: local loss {loss.item():.4f}")
            if step == args.steps:
                break

    state = accelerator.get_state_dict(model)  # the ranks' average (a collective: every rank calls it)
    flat = torch.cat([v.reshape(-1) for v in state.values()])
    agree = bool(torch.equal(accelerator.gather(flat[None]).min(0).values, accelerator.gather(flat[None]).max(0).values))
    accelerator.print(f"final loss {first:.4f} -> {full_loss(probe, state, data):.4f}, ranks agree: {agree}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
