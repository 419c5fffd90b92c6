"""B11: data throughput of a prepared DataLoader against a plain DataLoader + DistributedSampler.

Two CPU ranks (torchrig's test worker pool, gloo), every loader reading the same dataset. Each
trial builds three fresh loaders — the plain one, the prepared one and a second plain one (the
A/A control) — in an order rotating by trial, then runs two pairs of loaders, each pair
strictly alternating epochs (prepared with plain, then the control with plain), so each side's
epoch always follows the other's: a third loader in between would warm the code of whichever
side shares it (the control runs the plain loader's sampler code; nothing else runs
torchrig's). Both ranks run each epoch together after a barrier, so they compete for the cores
as a real job does; a round is one epoch of each side of a pair.

The result is the job's: a data-parallel job goes at the pace of its slowest rank, so a round's
rate of a loader is the slower rank's batches/s, a trial's ratio is the median over its rounds
of prepared ÷ plain in the same round, and the result is the median over trials. The control's
ratio (control ÷ plain, the same way) says how far the procedure itself reads from 1. Each
rank's own ratio (the same medians on one rank) is printed beside it; the worst of the two ranks'
ratios is not the result because it is biased low — the smaller of two noisy readings — and
its A/A control read 0.974–0.985 on (d) for two identical plain loaders. Where a loader's
objects land in memory moves its speed by a few percent for as long as it lives (in one set
of loaders, the A/A of (d) read 0.93–0.98), so fresh loaders per trial average that out. An
epoch is short (~40 batches, 2–70 ms), so the default 6 trials × 20 rounds stay cheap.
Cases:

(a) map-style ``TensorDataset``, batch 64, ``num_workers=0``, shuffled;
(b) map-style, ``__getitem__`` costing ~50 µs (busy work), batch 16, ``num_workers=2`` with
    persistent workers, shuffled;
(c) an ``IterableDataset`` stream with dispatch (rank 0 reads, every rank receives its batch),
    against each rank reading the stream and keeping every other batch (reported, no goal:
    dispatch trades reading on every rank for one broadcast per batch);
(d) variable-length token sequences (8–128 tokens), batch 32, a padding ``collate_fn``, shuffled.

Goal: ≥ 0.99 for (a), (b) and (d). The prepared loaders keep their exact-resume bookkeeping.

    python benchmarks/bench_data.py [--trials 6] [--rounds 20]
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
#: The measured side of each pair -> the key of the plain loader's rates in that pair.
PAIRS = {"prepared": "plain", "control": "plain_aa"}


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


def _dataset(case: str, world: int):
    """The job's dataset for ``case`` (built once: every loader of a case reads the same one)."""
    if case == "a":
        return torch.utils.data.TensorDataset(torch.randn(64 * 40 * world, 32), torch.randint(0, 10, (64 * 40 * world,)))
    if case == "b":
        return SlowItems(16 * 30 * world)
    if case == "c":
        return Stream(32 * 40 * world)
    return Sentences(32 * 40 * world)


def _plain(case: str, data, rank: int, world: int):
    """(the hand-written loader, its DistributedSampler or None)."""
    from torch.utils.data import DataLoader, DistributedSampler

    if case == "c":
        return DataLoader(EveryOther(data, 32, rank, world), batch_size=32), None
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    if case == "a":
        return DataLoader(data, batch_size=64, sampler=sampler), sampler
    if case == "b":
        return DataLoader(data, sampler=sampler, batch_size=16, num_workers=2, persistent_workers=True), sampler
    return DataLoader(data, batch_size=32, sampler=sampler, collate_fn=pad_collate), sampler


def _to_prepare(case: str, data):
    """(the DataLoader the user hands to ``prepare``, the dataloader_config it runs with)."""
    from torch.utils.data import DataLoader

    if case == "a":
        return DataLoader(data, batch_size=64, shuffle=True), {}
    if case == "b":
        return DataLoader(data, shuffle=True, batch_size=16, num_workers=2, persistent_workers=True), {}
    if case == "c":
        return DataLoader(data, batch_size=32), {"dispatch_batches": True}
    return DataLoader(data, batch_size=32, shuffle=True, collate_fn=pad_collate), {}


def _timed_epoch(loader, sampler, epochs: dict, name: str):
    def epoch() -> float:
        if sampler is not None:
            sampler.set_epoch(epochs[name])
        epochs[name] += 1
        start, n = time.perf_counter(), 0
        for _ in loader:
            n += 1
        epochs["batches"] = n
        return n / (time.perf_counter() - start)

    return epoch


def measure(ctx, case: str, trials: int, rounds: int) -> dict:
    import torch.distributed as dist
    from torchrig import Accelerator
    from torchrig.config.options import DataLoaderConfiguration
    from torchrig.testing.contracts import rank_environment

    torch.set_num_threads(1)
    with rank_environment(ctx.rank, ctx.world_size):
        data = _dataset(case, ctx.world_size)
        _, options = _to_prepare(case, data)
        accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**options))
        epochs = {"plain": 0, "prepared": 0, "control": 0, "batches": 0}
        #: Per side of a pair, per trial: the batches/s of each round ("plain" pairs with
        #: "prepared", "plain_aa" is the same plain loader paired with the control).
        rates: dict[str, list[list[float]]] = {"plain": [], "prepared": [], "plain_aa": [], "control": []}

        def build(name: str):
            if name == "prepared":
                return _timed_epoch(accelerator.prepare(_to_prepare(case, data)[0]), None, epochs, name)
            return _timed_epoch(*_plain(case, data, ctx.rank, ctx.world_size), epochs, name)

        names = ["plain", "prepared", "control"]
        for trial in range(trials):
            # Fresh loaders each trial, built in a rotating order: where a loader's objects land in
            # memory moves its speed by a few percent (the A/A control shows how much); new ones
            # each trial average that out instead of crowning whichever was built first.
            shift = trial % len(names)
            runs = {name: build(name) for name in names[shift:] + names[:shift]}
            for name in names:  # warm up: workers started, caches filled
                dist.barrier()
                runs[name]()
            for measured, plain_key in PAIRS.items():  # each pair strictly alternates (module docstring)
                pair = [("plain", plain_key), (measured, measured)]
                if trial % 2:
                    pair.reverse()
                trial_rates: dict[str, list[float]] = {key: [] for _, key in pair}
                for _ in range(rounds):
                    for name, key in pair:
                        dist.barrier()
                        trial_rates[key].append(runs[name]())
                for key, values in trial_rates.items():
                    rates[key].append(values)
            del runs
        result: dict = {"rates": rates, "batches": epochs["batches"]}
        accelerator.end_training()
        return result


def paired_ratio(rates: dict[str, list[list[float]]], name: str) -> tuple[float, list[float]]:
    """(median over trials, each trial's value) of the median over rounds of ``name`` ÷ the
    plain loader it alternated with."""
    trials = [statistics.median(a / b for a, b in zip(mine, plain, strict=True))
              for mine, plain in zip(rates[name], rates[PAIRS[name]], strict=True)]
    return statistics.median(trials), trials


def job_rates(per_rank: list[dict]) -> dict[str, list[list[float]]]:
    """Each round's rate of the job: the slowest rank's (the job waits for it)."""
    names = per_rank[0]["rates"]
    return {name: [[min(rank_rounds) for rank_rounds in zip(*trial_rounds, strict=True)]
                   for trial_rounds in zip(*(r["rates"][name] for r in per_rank), strict=True)]
            for name in names}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    from torchrig.testing.pool import WorkerPool

    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    ratios: dict[str, float] = {}
    controls: dict[str, float] = {}
    print(f"B11 data throughput, 2 CPU ranks, {args.trials} trials of fresh loaders x {args.rounds} interleaved "
          "rounds of one epoch each; a round's rate is the slower rank's")
    with WorkerPool(world_size=2) as pool:
        for case in wanted:
            per_rank = pool.run(measure, case, args.trials, args.rounds, timeout=1800)
            job = job_rates(per_rank)
            ratios[case], trials = paired_ratio(job, "prepared")
            controls[case], _ = paired_ratio(job, "control")
            shown = ", ".join(
                f"rank {i}: plain {statistics.median(sum(r['rates']['plain'], [])):.0f} batches/s, prepared "
                f"{statistics.median(sum(r['rates']['prepared'], [])):.0f}, ratio {paired_ratio(r['rates'], 'prepared')[0]:.3f} "
                f"(A/A {paired_ratio(r['rates'], 'control')[0]:.3f})" for i, r in enumerate(per_rank))
            print(f"  ({case}) {per_rank[0]['batches']} batches/epoch/rank; job ratio {ratios[case]:.3f} "
                  f"(trials {' '.join(f'{t:.3f}' for t in trials)}), A/A {controls[case]:.3f}; {shown}")
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
