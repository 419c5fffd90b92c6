"""B11: data throughput of a prepared DataLoader against a plain DataLoader + DistributedSampler.

Two CPU ranks (torchrig's test worker pool, gloo). In every round each rank iterates one epoch
of the plain loader, one of the prepared loader and one of a second, identical plain loader (the
A/A control), in an order rotating by round, both ranks together after a barrier, so they compete
for the cores as a real job does; batches/s from the median epoch time of each. The ratio is
prepared ÷ plain, the worst rank's; the control's ratio (control ÷ plain, worst rank) says how
far the procedure itself reads from 1. An epoch is short (~40 batches, 2–15 ms), so a round is
cheap and the default of 60 rounds keeps the medians' noise well under the 1% the goal
resolves. Cases:

(a) map-style ``TensorDataset``, batch 64, ``num_workers=0``, shuffled;
(b) map-style, ``__getitem__`` costing ~50 µs (busy work), batch 16, ``num_workers=2`` with
    persistent workers, shuffled;
(c) an ``IterableDataset`` stream with dispatch (rank 0 reads, every rank receives its batch),
    against each rank reading the stream and keeping every other batch (reported, no goal:
    dispatch trades reading on every rank for one broadcast per batch);
(d) variable-length token sequences (8–128 tokens), batch 32, a padding ``collate_fn``, shuffled.

Goal: ≥ 0.99 for (a), (b) and (d). The prepared loaders keep their exact-resume bookkeeping.

    python benchmarks/bench_data.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from _report import emit

GOAL = 0.99
CASES = ("a", "b", "c", "d")


class SlowItems(torch.utils.data.Dataset):
    """A map-style dataset whose ``__getitem__`` costs ~50 µs (decoding, augmentation)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        end = time.perf_counter() + 50e-6
        while time.perf_counter() < end:
            pass
        return torch.full((16,), float(i)), i % 10


class Stream(torch.utils.data.IterableDataset):
    """A stream of ``n`` samples (a sharded-file reader, a generator of synthetic data)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for i in range(self.n):
            yield torch.full((32,), float(i)), i % 10


class EveryOther(torch.utils.data.IterableDataset):
    """The hand-written sharding of a stream: rank ``r`` of ``w`` keeps batches ``r, r + w, ...``."""

    def __init__(self, stream: Stream, batch: int, rank: int, world: int) -> None:
        self.stream, self.batch, self.rank, self.world = stream, batch, rank, world

    def __iter__(self):
        for i, sample in enumerate(self.stream):
            if (i // self.batch) % self.world == self.rank:
                yield sample


class Sentences(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(8, 129, (n,), generator=generator).tolist()
        self.items = [torch.randint(0, 30000, (length,), generator=generator) for length in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def pad_collate(sequences):
    tokens = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    return {"input_ids": tokens, "attention_mask": tokens != 0}


def _loaders(case: str, rank: int, world: int):
    """(plain loader with its sampler or None, the DataLoader torchrig prepares, dataloader_config);
    each call builds fresh loaders over fresh (identical) data."""
    from torch.utils.data import DataLoader, DistributedSampler

    if case == "a":
        data = torch.utils.data.TensorDataset(torch.randn(64 * 40 * world, 32), torch.randint(0, 10, (64 * 40 * world,)))
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
        return (DataLoader(data, batch_size=64, sampler=sampler), sampler,
                DataLoader(data, batch_size=64, shuffle=True), {})
    if case == "b":
        data = SlowItems(16 * 30 * world)
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
        common = dict(batch_size=16, num_workers=2, persistent_workers=True)
        return (DataLoader(data, sampler=sampler, **common), sampler, DataLoader(data, shuffle=True, **common), {})
    if case == "c":
        stream = Stream(32 * 40 * world)
        return (DataLoader(EveryOther(stream, 32, rank, world), batch_size=32), None,
                DataLoader(stream, batch_size=32), {"dispatch_batches": True})
    data = Sentences(32 * 40 * world)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    return (DataLoader(data, batch_size=32, sampler=sampler, collate_fn=pad_collate), sampler,
            DataLoader(data, batch_size=32, shuffle=True, collate_fn=pad_collate), {})


def measure(ctx, case: str, rounds: int) -> dict:
    import torch.distributed as dist
    from torchrig import Accelerator
    from torchrig.config.options import DataLoaderConfiguration
    from torchrig.testing.contracts import rank_environment

    torch.set_num_threads(1)
    with rank_environment(ctx.rank, ctx.world_size):
        plain, sampler, raw, options = _loaders(case, ctx.rank, ctx.world_size)
        control, control_sampler, _, _ = _loaders(case, ctx.rank, ctx.world_size)
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**options))
        prepared = accelerator.prepare(raw)
        epochs = {"plain": 0, "control": 0, "batches": 0}

        def plain_epoch_of(name, loader, its_sampler):
            def plain_epoch() -> float:
                if its_sampler is not None:
                    its_sampler.set_epoch(epochs[name])
                epochs[name] += 1
                start, n = time.perf_counter(), 0
                for _ in loader:
                    n += 1
                return n / (time.perf_counter() - start)

            return plain_epoch

        def prepared_epoch() -> float:
            start, n = time.perf_counter(), 0
            for _ in prepared:
                n += 1
            epochs["batches"] = n
            return n / (time.perf_counter() - start)

        runs = [("plain", plain_epoch_of("plain", plain, sampler)), ("prepared", prepared_epoch),
                ("control", plain_epoch_of("control", control, control_sampler))]
        for _, run in runs:  # warm up: workers started, caches filled
            dist.barrier()
            run()
        rates: dict[str, list[float]] = {name: [] for name, _ in runs}
        for index in range(rounds):
            shift = index % len(runs)
            for name, run in runs[shift:] + runs[:shift]:
                dist.barrier()
                rates[name].append(run())
        result = {name: statistics.median(values) for name, values in rates.items()}
        result["batches"] = epochs["batches"]
        accelerator.end_training()
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    from torchrig.testing.pool import WorkerPool

    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    ratios: dict[str, float] = {}
    controls: dict[str, float] = {}
    print(f"B11 data throughput, 2 CPU ranks, {args.rounds} interleaved rounds of one epoch each")
    with WorkerPool(world_size=2) as pool:
        for case in wanted:
            per_rank = pool.run(measure, case, args.rounds, timeout=1800)
            ratio = min(r["prepared"] / r["plain"] for r in per_rank)
            ratios[case] = ratio
            controls[case] = min(r["control"] / r["plain"] for r in per_rank)
            shown = ", ".join(f"rank {i}: plain {r['plain']:.0f} batches/s, prepared {r['prepared']:.0f}, "
                              f"control {r['control']:.0f}" for i, r in enumerate(per_rank))
            print(f"  ({case}) {per_rank[0]['batches']} batches/epoch/rank; {shown}; ratio (worst rank) {ratio:.3f}, "
                  f"A/A {controls[case]:.3f}")
    goals = [c for c in ("a", "b", "d") if c in ratios]
    ok = all(ratios[c] >= GOAL for c in goals) if goals else None
    print("B11 prepared ÷ plain batches/s: " + ", ".join(f"({c}) {ratios[c]:.3f}" for c in ratios)
          + f" (goal ≥ {GOAL} for a, b, d; c reported): {'PASS' if ok else 'FAIL'}; A/A control ÷ plain: "
          + ", ".join(f"({c}) {controls[c]:.3f}" for c in controls))
    emit("B11", "prepared ÷ plain DataLoader+DistributedSampler batches/s, 2 ranks: (a) map (b) workers (c) dispatch (d) text",
         " ".join(f"({c}) {ratios[c]:.3f}" for c in ratios) + " (A/A " + " ".join(f"{controls[c]:.3f}" for c in controls) + ")",
         f"≥ {GOAL} (a, b, d)", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
