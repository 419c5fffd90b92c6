"""Train a small MLP on synthetic data — the README demo.

Runs in seconds on a CPU; the same script runs on several processes or GPUs:

    python examples/train_mlp.py
    torchrig launch --num_processes 2 --cpu examples/train_mlp.py

It uses the usual Accelerate-style loop: prepare, accumulate, backward, clip_grad_norm_,
gather_for_metrics, main_process_first, unwrap_model. With --throughput the throughput monitor
measures samples/s, step time and peak memory every 10 optimizer steps and the progress line
shows them (they also go to any tracker given with log_with). With TORCHRIG_LOG_LEVEL=INFO the
plugins' notes are printed, e.g. fp8's "converted 2 of 3 Linear layers" (--mixed_precision fp8; on a
CPU also --fp8_emulate or TORCHRIG_FP8_CONFIG__EMULATE=1).
"""

from __future__ import annotations

import argparse
import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchrig import Accelerator
from torchrig.config.options import ThroughputMonitorConfig
from torchrig.utils import set_seed
from tqdm.auto import tqdm


def make_data(n: int, seed: int) -> TensorDataset:
    """A learnable 3-class problem: the class is decided by a fixed random projection."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(n, 32, generator=generator)
    projection = torch.randn(32, 3, generator=torch.Generator().manual_seed(1234))
    labels = (features @ projection).argmax(dim=1)
    return TensorDataset(features, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--mixed_precision", default=None, help="no, fp16, bf16 or fp8 (default: from the configuration)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--throughput", action="store_true", help="measure samples/s and show it in the progress line")
    args = parser.parse_args()
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # the level: TORCHRIG_LOG_LEVEL

    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              mixed_precision=args.mixed_precision,
                              kwargs_handlers=[ThroughputMonitorConfig(enabled=args.throughput, log_every_n_steps=10)])
    set_seed(args.seed)
    with accelerator.main_process_first():
        train, evaluation = make_data(4096, seed=0), make_data(1000, seed=1)

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    train_loader = DataLoader(train, batch_size=args.batch_size, shuffle=True)
    eval_loader = DataLoader(evaluation, batch_size=args.batch_size)
    total_steps = args.epochs * len(train_loader) // args.gradient_accumulation_steps
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=max(total_steps, 1))
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    for epoch in range(args.epochs):
        model.train()
        progress = tqdm(train_loader, desc=f"epoch {epoch}", disable=not accelerator.is_local_main_process)
        for features, labels in progress:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(features), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            shown = {"loss": f"{loss.item():.4f}"}
            if accelerator.throughput.latest:  # measured every 10 optimizer steps with --throughput
                shown["speed"] = accelerator.throughput.progress()
            progress.set_postfix(shown, refresh=False)

        model.eval()
        correct = seen = 0
        for features, labels in eval_loader:
            with torch.no_grad():
                predictions = model(features).argmax(dim=1)
            predictions, labels = accelerator.gather_for_metrics((predictions, labels))
            correct += (predictions == labels).sum().item()
            seen += labels.numel()
        speed = f" ({accelerator.throughput.progress()})" if accelerator.throughput.latest else ""
        accelerator.print(f"epoch {epoch}: loss {loss.item():.4f}, accuracy {correct / seen:.3f} on {seen} samples{speed}")

    weights = accelerator.unwrap_model(model).state_dict()
    accelerator.print(f"done: {accelerator.num_processes} process(es), strategy {accelerator.strategy}, "
                      f"{sum(t.numel() for t in weights.values())} parameters")


if __name__ == "__main__":
    main()
