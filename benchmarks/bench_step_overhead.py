"""B1: per-step overhead of torchrig against a hand-written PyTorch loop, in one process.

What users run: every block is one epoch of a shuffled map-style DataLoader (a ``TensorDataset``
of ``steps`` batches), iterated and stepped — through ``accelerator.prepare``'d model, optimizer
and loader, against the same loop written by hand on a plain ``DataLoader(shuffle=True)`` (one
process: no DistributedSampler). Pinned model: MLP 32→64→64→10, batch 64, AdamW, one thread.
The loops run in this process on identical copies of the model and data; blocks are interleaved
in a rotating order so machine noise hits all alike. Reported: median µs/step of each, the median
added time per step and per-round ratio with a bootstrap 95% confidence interval, and the A/A
noise floor (plain against plain-again). Goal: added ≤ 10 µs/step and ≤ 1.01×. Sub-rows: the
step alone on pre-made batches (no loader), inside ``accumulate``, and "torchrig + throughput
monitor" (``throughput_monitor.enabled`` with its defaults: a measurement every 50 optimizer steps,
to no tracker) against an Accelerator made the same way without it ("torchrig, monitor off"; goal
≤ 5 µs/step), and "torchrig + training guard" (``training_guard.enabled``: each optimizer step's loss and
gradient norm checked) against the same baseline (goal ≤ 1 µs/step). Hugging Face Accelerate
and Lightning Fabric run the same loop (their own prepared loader) in the same rounds when
installed (`pip install 'torchrig[bench]'`).

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
from torch.utils.data import DataLoader, TensorDataset

BUDGET_US = 10.0
MONITOR_BUDGET_US = 5.0
MONITOR = "torchrig + throughput monitor"
MONITOR_OFF = "torchrig, monitor off"  # its baseline: an Accelerator made the same way, without the monitor
GUARD = "torchrig + training guard"  # training_guard.enabled against the same baseline (issue 38)
GUARD_BUDGET_US = 1.0
BUDGET_RATIO = 1.01
BATCH = 64


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


def loader_step_fn(model, optimizer, backward, loader):
    """One epoch of ``loader`` per block, as a training loop iterates it; µs per step."""
    loss_fn = nn.functional.cross_entropy

    def run(n: int) -> float:
        start = time.perf_counter()
        steps = 0
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            backward(loss)
            optimizer.step()
            steps += 1
        return (time.perf_counter() - start) / steps

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


def accelerate_step_fn(dataset):
    """Hugging Face Accelerate's loop (its prepared loader) on its own copy of the model, or None."""
    try:
        from accelerate import Accelerator as HFAccelerator
    except ImportError:
        return None
    accelerator = HFAccelerator(cpu=True)
    model = make_model()
    model, optimizer, loader = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                                   DataLoader(dataset, batch_size=BATCH, shuffle=True))
    return loader_step_fn(model, optimizer, accelerator.backward, loader)


def fabric_step_fn(dataset):
    """Lightning Fabric's loop (its set-up loader) on its own copy of the model, or None."""
    try:
        from lightning.fabric import Fabric
    except ImportError:
        return None
    fabric = Fabric(accelerator="cpu", devices=1)
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=BATCH, shuffle=True))
    return loader_step_fn(model, optimizer, fabric.backward, loader)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from torchrig import Accelerator
    from torchrig.config.options import ThroughputMonitorConfig, TrainingGuardConfig

    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(args.steps * BATCH, 32, generator=generator),
                            torch.randint(0, 10, (args.steps * BATCH,), generator=generator))
    batches = [(dataset.tensors[0][i:i + BATCH], dataset.tensors[1][i:i + BATCH])
               for i in range(0, len(dataset), BATCH)]
    base = make_model()
    models = {name: copy.deepcopy(base) for name in ("plain", "plain-again", "torchrig", "plain/batches", "torchrig/batches",
                                                     MONITOR_OFF, MONITOR, GUARD)}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-3) for name, model in models.items()}
    accelerator = Accelerator(cpu=True)
    rig_model, rig_optimizer, rig_loader = accelerator.prepare(models["torchrig"], optimizers["torchrig"],
                                                               DataLoader(dataset, batch_size=BATCH, shuffle=True))
    step_model, step_optimizer = accelerator.prepare(models["torchrig/batches"], optimizers["torchrig/batches"])
    monitor_runs = {}
    for name, handler in ((MONITOR_OFF, ThroughputMonitorConfig(enabled=False)),
                          (MONITOR, ThroughputMonitorConfig(enabled=True)), (GUARD, TrainingGuardConfig(enabled=True))):
        monitored = Accelerator(cpu=True, kwargs_handlers=[handler])
        monitor_model, monitor_optimizer, monitor_loader = monitored.prepare(
            models[name], optimizers[name], DataLoader(dataset, batch_size=BATCH, shuffle=True))
        monitor_runs[name] = loader_step_fn(monitor_model, monitor_optimizer, monitored.backward, monitor_loader)

    def plain_loader() -> DataLoader:
        return DataLoader(dataset, batch_size=BATCH, shuffle=True)

    runners = {
        "plain": loader_step_fn(models["plain"], optimizers["plain"], torch.Tensor.backward, plain_loader()),
        "plain-again": loader_step_fn(models["plain-again"], optimizers["plain-again"], torch.Tensor.backward,
                                      plain_loader()),
        "torchrig": loader_step_fn(rig_model, rig_optimizer, accelerator.backward, rig_loader),
        "plain/batches": plain_step_fn(models["plain/batches"], optimizers["plain/batches"], batches),
        "torchrig/batches": framework_step_fn(step_model, step_optimizer, accelerator.backward, batches),
        "torchrig/accumulate": accumulate_step_fn(accelerator, step_model, step_optimizer, batches),
        **monitor_runs,
    }
    for name, make in (("accelerate", accelerate_step_fn), ("fabric", fabric_step_fn)):
        peer = make(dataset)  # measured beside torchrig when installed (`pip install 'torchrig[bench]'`)
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

    print(f"B1 step overhead — MLP 32-64-64-10, batch {BATCH}, AdamW, 1 thread; {args.rounds} rounds × one "
          f"epoch of {args.steps} steps")
    print(f"{'loop':<29} {'median µs/step':>15} {'added µs (median, 95% CI)':>32} {'ratio (median, 95% CI)':>30}")
    added, ratio = {}, {}
    for name in runners:
        baseline = samples["plain/batches" if name in ("torchrig/batches", "torchrig/accumulate")
                           else MONITOR_OFF if name in (MONITOR, GUARD) else "plain"]
        diffs = [a - b for a, b in zip(samples[name], baseline)]
        ratios = [a / b for a, b in zip(samples[name], baseline)]
        added[name], ratio[name] = statistics.median(diffs), statistics.median(ratios)
        (low, high), (rlow, rhigh) = bootstrap_ci(diffs), bootstrap_ci(ratios)
        shown = "—" if name in ("plain", "plain/batches", MONITOR_OFF) else f"{added[name]:+.1f} [{low:+.1f}, {high:+.1f}]"
        shown_ratio = "—" if name in ("plain", "plain/batches", MONITOR_OFF) else f"{ratio[name]:.4f} [{rlow:.4f}, {rhigh:.4f}]"
        print(f"{name:<29} {statistics.median(samples[name]):>15.1f} {shown:>32} {shown_ratio:>30}")
    noise = added["plain-again"]
    ok = added["torchrig"] <= BUDGET_US and ratio["torchrig"] <= BUDGET_RATIO
    print(f"A/A noise floor (plain-again − plain): {noise:+.1f} µs ({ratio['plain-again']:.4f}×)")
    monitor_ok = added[MONITOR] <= MONITOR_BUDGET_US
    print(f"B1 {MONITOR}: {added[MONITOR]:+.1f} µs/step over the same Accelerator without it (goal ≤ {MONITOR_BUDGET_US:.0f} µs): "
          f"{'PASS' if monitor_ok else 'FAIL'}")
    emit("B1 monitor", "added µs/step of the throughput monitor: torchrig + monitor vs torchrig, same real loop",
         f"{added[MONITOR]:+.1f} µs ({ratio[MONITOR]:.4f}×)", f"≤ {MONITOR_BUDGET_US:.0f} µs", monitor_ok, {})
    guard_ok = added[GUARD] <= GUARD_BUDGET_US
    print(f"B1 {GUARD}: {added[GUARD]:+.1f} µs/step over the same Accelerator without it (goal ≤ {GUARD_BUDGET_US:.0f} µs): "
          f"{'PASS' if guard_ok else 'FAIL'}")
    emit("B1 guard", "added µs/step of training_guard.enabled: torchrig + guard vs torchrig, same real loop",
         f"{added[GUARD]:+.1f} µs ({ratio[GUARD]:.4f}×)", f"≤ {GUARD_BUDGET_US:.0f} µs", guard_ok, {})
    print(f"B1 torchrig added {added['torchrig']:+.1f} µs/step, {ratio['torchrig']:.4f}× over a plain DataLoader loop "
          f"(goal ≤ {BUDGET_US:.0f} µs and ≤ {BUDGET_RATIO}×; A/A {noise:+.1f} µs); the step alone on pre-made "
          f"batches {added['torchrig/batches']:+.1f} µs: {'PASS' if ok else 'FAIL'}")
    peers = {name: f"{added[name]:+.1f} µs ({ratio[name]:.3f}×)" for name in ("accelerate", "fabric") if name in added}
    emit("B1", "added µs/step, real loop: prepared DataLoader + step vs plain (tiny MLP, 1 thread); A/A beside it",
         f"{added['torchrig']:+.1f} µs, {ratio['torchrig']:.4f}× (A/A {noise:+.1f}; pre-made batches "
         f"{added['torchrig/batches']:+.1f})", f"≤ {BUDGET_US:.0f} µs, ≤ {BUDGET_RATIO}×", ok, peers)
    return 0 if ok and monitor_ok else 1


if __name__ == "__main__":
    sys.exit(main())
