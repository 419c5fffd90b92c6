"""B2 and B3: the ddp strategy against hand-written DistributedDataParallel, inside one 2-rank job.

B2  ~4M-parameter MLP, batch 64 per rank, AdamW, 2 CPU processes over gloo. Each rank trains a
    hand-written DDP copy and a torchrig (Accelerator, strategy ddp) copy of the same model on
    the same batches, in interleaved blocks; steps/s ratio from the median block times, and the
    two copies' final weights must be bit-identical. The job runs twice in fresh processes, once
    with each copy built first (the first-built copy can run faster: see bench_gpu_sharded.measure);
    the ratio is the geometric mean of the two. Goal: ratio ≥ 0.99.
B3  gradient accumulation 4: backward passes that fire DDP's communication hook — zero on the
    micro-steps, one round (DDP's bucket count) on each optimizer step.

    python benchmarks/bench_ddp.py [--rounds 20] [--steps 5]

The ranks run on torchrig's test worker pool (a FileStore rendezvous, no ports).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time

import torch
from _report import emit


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1], torch.nn.Linear(1024, 10))


def b2(ctx, rounds: int, steps: int, rig_first: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel
    from torchrig import Accelerator
    from torchrig.testing.contracts import rank_environment

    torch.set_num_threads(1)
    with rank_environment(ctx.rank, ctx.world_size):
        base = _model()

        def build_hand():
            hand = DistributedDataParallel(copy.deepcopy(base))
            return hand, torch.optim.AdamW(hand.parameters(), lr=1e-4)

        def build_rig():
            accelerator = Accelerator(cpu=True, strategy="ddp")
            rig_model = copy.deepcopy(base)
            return (accelerator, *accelerator.prepare(rig_model, torch.optim.AdamW(rig_model.parameters(), lr=1e-4)))

        if rig_first:
            accelerator, rig, rig_opt = build_rig()
            hand, hand_opt = build_hand()
        else:
            hand, hand_opt = build_hand()
            accelerator, rig, rig_opt = build_rig()
        generator = torch.Generator().manual_seed(ctx.rank)
        batches = [(torch.randn(64, 1024, generator=generator), torch.randint(0, 10, (64,), generator=generator))
                   for _ in range(steps)]
        loss_fn = torch.nn.functional.cross_entropy

        def hand_block() -> float:
            start = time.perf_counter()
            for x, y in batches:
                hand_opt.zero_grad(set_to_none=True)
                loss_fn(hand(x), y).backward()
                hand_opt.step()
            return (time.perf_counter() - start) / steps

        def rig_block() -> float:
            start = time.perf_counter()
            for x, y in batches:
                rig_opt.zero_grad(set_to_none=True)
                accelerator.backward(loss_fn(rig(x), y))
                rig_opt.step()
            return (time.perf_counter() - start) / steps

        hand_times, rig_times = [], []
        for index in range(rounds):
            first, second = (hand_block, rig_block) if index % 2 == 0 else (rig_block, hand_block)
            a, b = first(), second()
            hand_times.append(a if first is hand_block else b)
            rig_times.append(b if first is hand_block else a)
        identical = all(torch.equal(p, q) for p, q in zip(hand.module.parameters(), accelerator.unwrap_model(rig).parameters()))
        params = sum(p.numel() for p in base.parameters())
        return {"hand": statistics.median(hand_times), "rig": statistics.median(rig_times), "identical": identical,
                "params": params}


def b3(ctx, micro_steps: int, cycles: int) -> list[int]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torchrig import Accelerator
    from torchrig.testing.contracts import rank_environment

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="ddp", gradient_accumulation_steps=micro_steps)
        model = _model()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
        calls: list[int] = []

        def counting(state, bucket):
            calls.append(1)
            return default_hooks.allreduce_hook(state, bucket)

        model.register_comm_hook(None, counting)
        per_backward = []
        for _ in range(cycles * micro_steps):
            before = len(calls)
            with accelerator.accumulate(model):
                accelerator.backward(model(torch.randn(16, 1024)).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
            per_backward.append(len(calls) - before)
        return per_backward


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    from torchrig.testing.pool import WorkerPool

    orders = []
    for rig_first in (False, True):
        with WorkerPool(world_size=2) as pool:
            orders.append(pool.run(b2, args.rounds, args.steps, rig_first, timeout=1800))
            if not rig_first:
                comm = pool.run(b3, 4, 3, timeout=600)[0]
    (h0, h1), (f0, f1) = orders
    per_rank = [math.sqrt(h["hand"] / h["rig"] * f["hand"] / f["rig"]) for h, f in ((h0, f0), (h1, f1))]
    ratio = min(per_rank)
    identical = all(r["identical"] for r in (h0, h1, f0, f1))
    print(f"B2 DDP, {h0['params'] / 1e6:.1f}M-parameter MLP, batch 64/rank, AdamW, 2 CPU processes, "
          f"2 build orders × {args.rounds} interleaved rounds × {args.steps} steps")
    for rank, (h, f) in enumerate(((h0, f0), (h1, f1))):
        print(f"  rank {rank}: hand-written {2 / (h['hand'] + f['hand']):.2f} steps/s, torchrig "
              f"{2 / (h['rig'] + f['rig']):.2f} steps/s, ratio {per_rank[rank]:.3f} (hand-written built first "
              f"{h['hand'] / h['rig']:.3f}, torchrig built first {f['hand'] / f['rig']:.3f}), final weights "
              f"bit-identical: {h['identical'] and f['identical']}")
    b2_ok = ratio >= 0.99 and identical
    print(f"B2 steps/s ratio (worst rank) {ratio:.3f} (goal ≥ 0.99), bit-identical: {identical}: "
          f"{'PASS' if b2_ok else 'FAIL'}")
    micro = [n for i, n in enumerate(comm) if i % 4 != 3]
    boundary = [n for i, n in enumerate(comm) if i % 4 == 3]
    b3_ok = all(n == 0 for n in micro) and len(set(boundary)) == 1 and boundary[0] >= 1
    print(f"B3 accumulation 4: comm-hook calls per backward {comm}: micro-steps {sum(micro)}, "
          f"optimizer steps {boundary} (one round of {boundary[0]} bucket(s) each): {'PASS' if b3_ok else 'FAIL'}")
    emit("B2", "DDP plugin ÷ hand-written DDP steps/s (2 CPU processes), bit-identical weights",
         f"{ratio:.3f}, identical: {identical}", "≥ 0.99, identical", b2_ok)
    emit("B3", "accumulation 4: comm-hook calls on micro-steps / per optimizer step",
         f"{sum(micro)} / {boundary[0] if boundary else 0}", "0 / one round", b3_ok)
    return 0 if b2_ok and b3_ok else 1


if __name__ == "__main__":
    sys.exit(main())
