"""B6 sharded: the blocking part of an asynchronous ``save_state`` of FSDP2-sharded state ÷ the synchronous save.

Two CPU ranks over gloo, FSDP2 (``SHARDED_STATE_DICT``: every rank writes its DCP shards) of a stack of
``--layers`` × Linear(``--width``) with AdamW state after one step (default 8 × 1024²: 8.4M parameters,
~100 MB of model + optimizer tensors, half per rank). Each round saves once synchronously and once with
``async_save=True`` (the side first alternates), after an untimed ``os.sync()``; the async save's blocking
part is the time until ``save_state`` returns (the CPU staging of each rank's shards), its completion the
time until it committed. As in B6, the goal is checked on each side's fastest sample (the noise of this
VM's disk only ever adds time); medians are printed beside it. Goal: blocking ÷ synchronous ≤ 0.25.

    python benchmarks/bench_checkpoint_sharded.py [--rounds 6] [--layers 8] [--width 1024] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _report import emit

GOAL = 0.25
WORLD = 2


def _rank(rank: int, init: str, work: str, args: argparse.Namespace, results: dict) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    from torchrig import Accelerator
    from torchrig_fsdp.options import FullyShardedDataParallelPlugin

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, strategy="fsdp",
                              fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
    model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.layers)))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    accelerator.backward(model(torch.randn(4, args.width)).pow(2).mean())
    optimizer.step()
    samples: dict[str, list[float]] = {"synchronous save": [], "async blocking": [], "async total": []}

    def synchronous(directory: str) -> None:
        start = time.perf_counter()
        accelerator.save_state(directory)
        samples["synchronous save"].append(time.perf_counter() - start)

    def asynchronous(directory: str) -> None:
        start = time.perf_counter()
        accelerator.save_state(directory, async_save=True)
        samples["async blocking"].append(time.perf_counter() - start)
        accelerator._wait_for_checkpoint()
        samples["async total"].append(time.perf_counter() - start)

    for round_index in range(args.rounds):
        sides = [synchronous, asynchronous] if round_index % 2 == 0 else [asynchronous, synchronous]
        for side in sides:
            os.sync()
            accelerator.wait_for_everyone()
            side(os.path.join(work, f"round{round_index}-{side.__name__}"))
        accelerator.wait_for_everyone()
        if rank == 0:
            for side in sides:
                shutil.rmtree(os.path.join(work, f"round{round_index}-{side.__name__}"))
    results[rank] = samples
    accelerator.end_training()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary folder)")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="torchrig-b6-sharded-", dir=args.dir)
    init = os.path.join(work, "init")
    try:
        with mp.Manager() as manager:
            results = manager.dict()
            mp.spawn(_rank, args=(init, work, args, results), nprocs=WORLD, join=True)
            results = dict(results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = 3 * 4 * args.layers * (args.width * args.width + args.width)  # parameters + AdamW's two moments, fp32
    print(f"B6 sharded: FSDP2 on {WORLD} CPU ranks, {size / 1e6:.0f} MB of model + optimizer tensors "
          f"({size / WORLD / 1e6:.0f} MB per rank), {args.rounds} rounds")
    ratios = []
    for rank in range(WORLD):
        samples = results[rank]
        print(f"  rank {rank}: " + "; ".join(
            f"{name} fastest {min(values):.3f} s, median {statistics.median(values):.3f} s" for name, values in samples.items()))
        ratios.append((min(samples["async blocking"]) / min(samples["synchronous save"]),
                       statistics.median(samples["async blocking"]) / statistics.median(samples["synchronous save"])))
    worst, worst_median = max(r[0] for r in ratios), max(r[1] for r in ratios)
    ok = worst <= GOAL
    print(f"async blocking ÷ synchronous save (worst rank, fastest samples): {worst:.2f} (medians {worst_median:.2f}; "
          f"goal ≤ {GOAL}) {'ok' if ok else 'MISSED'}")
    emit("B6 sharded", f"async save_state blocking ÷ sync, FSDP2 sharded state ({size / 1e6:.0f} MB, 2 CPU ranks)",
         f"{worst:.2f}", f"≤ {GOAL}", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
