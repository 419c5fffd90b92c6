"""B1: per-step overhead of torchrig against a hand-written PyTorch loop, in one process.

Pinned model: MLP 32→64→64→10, batch 64, AdamW, one thread. Both loops run in this process on
identical copies of the model and data; blocks of steps are interleaved (plain, torchrig,
plain-again) so machine noise hits all alike. Reported: median µs/step of each, the median
added time per step with a bootstrap 95% confidence interval, and the A/A noise floor (plain
against plain-again). Budget: median added ≤ 25 µs. Hugging Face Accelerate and Lightning Fabric
run the same loop in the same rounds when installed (`pip install 'torchrig[bench]'`).

    python benchmarks/bench_step_overhead.py [--rounds 60] [--steps 50]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time

import torch
from _report import emit
from _stats import bootstrap_ci
from torch import nn

BUDGET_US = 25.0


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def plain_step_fn(model, optimizer, batches):
    """The baseline, written as a user writes it (``loss.backward()``), not through the
    ``backward`` argument :func:`framework_step_fn` takes."""
    loss_fn = nn.functional.cross_entropy

    def run(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            x, y = batches[i % len(batches)]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
        return (time.perf_counter() - start) / n

    return run


def framework_step_fn(model, optimizer, backward, batches):
    """The plain loop with a framework's ``backward`` (torchrig's, Accelerate's, Fabric's)."""
    loss_fn = nn.functional.cross_entropy

    def run(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            x, y = batches[i % len(batches)]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            backward(loss)
            optimizer.step()
        return (time.perf_counter() - start) / n

    return run


def accumulate_step_fn(accelerator, model, optimizer, batches):
    """torchrig's loop inside ``accelerator.accumulate(model)``."""
    loss_fn = nn.functional.cross_entropy
    backward = accelerator.backward

    def run(n: int) -> float:
        start = time.perf_counter()
        for i in range(n):
            x, y = batches[i % len(batches)]
            with accelerator.accumulate(model):
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                backward(loss)
                optimizer.step()
        return (time.perf_counter() - start) / n

    return run


def accelerate_step_fn(batches):
    """Hugging Face Accelerate's loop on its own copy of the model, or None if not installed."""
    try:
        from accelerate import Accelerator as HFAccelerator
    except ImportError:
        return None
    accelerator = HFAccelerator(cpu=True)
    model = make_model()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return framework_step_fn(model, optimizer, accelerator.backward, batches)


def fabric_step_fn(batches):
    """Lightning Fabric's loop on its own copy of the model, or None if not installed."""
    try:
        from lightning.fabric import Fabric
    except ImportError:
        return None
    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return framework_step_fn(model, optimizer, fabric.backward, batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from torchrig import Accelerator

    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 32, generator=generator), torch.randint(0, 10, (64,), generator=generator))
               for _ in range(16)]
    base = make_model()
    plain_model, aa_model, rig_model = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    plain = plain_step_fn(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-3), batches)
    again = plain_step_fn(aa_model, torch.optim.AdamW(aa_model.parameters(), lr=1e-3), batches)
    accelerator = Accelerator(cpu=True)
    rig_model, rig_optimizer = accelerator.prepare(rig_model, torch.optim.AdamW(rig_model.parameters(), lr=1e-3))
    rig = framework_step_fn(rig_model, rig_optimizer, accelerator.backward, batches)
    rig_acc = accumulate_step_fn(accelerator, rig_model, rig_optimizer, batches)

    runners = {"plain": plain, "plain-again": again, "torchrig": rig, "torchrig+accumulate": rig_acc}
    for name, make in (("accelerate", accelerate_step_fn), ("fabric", fabric_step_fn)):
        peer = make(batches)  # measured beside torchrig when installed (`pip install 'torchrig[bench]'`)
        if peer is not None:
            runners[name] = peer
        else:
            print(f"({name} not installed: its row is skipped)")
    for run in runners.values():  # warm up
        run(args.steps)
    samples: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for round_index in range(args.rounds):
        rotation = order[round_index % len(order):] + order[: round_index % len(order)]
        for name in rotation:
            samples[name].append(runners[name](args.steps) * 1e6)

    plain_us = samples["plain"]
    print(f"B1 step overhead — MLP 32-64-64-10, batch 64, AdamW, 1 thread; {args.rounds} rounds × {args.steps} steps")
    print(f"{'loop':<22} {'median µs/step':>15} {'added µs (median, 95% CI)':>32}")
    results = {}
    for name in runners:
        diffs = [a - b for a, b in zip(samples[name], plain_us)]
        median, (low, high) = statistics.median(diffs), bootstrap_ci(diffs)
        results[name] = median
        added = "—" if name == "plain" else f"{median:+.1f} [{low:+.1f}, {high:+.1f}]"
        print(f"{name:<22} {statistics.median(samples[name]):>15.1f} {added:>32}")
    noise = abs(results["plain-again"])
    ok = results["torchrig"] <= BUDGET_US
    print(f"A/A noise floor (plain-again − plain): {results['plain-again']:+.1f} µs")
    print(f"B1 torchrig added {results['torchrig']:+.1f} µs/step (budget ≤ {BUDGET_US:.0f}; noise floor {noise:.1f}): "
          f"{'PASS' if ok else 'FAIL'}")
    peers = {name: f"{results[name]:+.1f} µs" for name in ("accelerate", "fabric") if name in results}
    emit("B1", "added µs/step vs plain PyTorch (tiny MLP, 1 thread); A/A noise beside it",
         f"{results['torchrig']:+.1f} µs (A/A {results['plain-again']:+.1f})", f"≤ {BUDGET_US:.0f} µs", ok, peers)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
