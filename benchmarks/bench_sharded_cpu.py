"""B9 and B10: the fsdp and deepspeed plugins ÷ hand-written equivalents on 2 CPU processes.

The CPU counterpart of B8 (same script pieces, ``bench_gpu_sharded.py``): a small GPT (4 layers,
d=256, sequence 128, ~3.7M parameters), batch 4 per rank, 2 ranks over gloo. Each rank trains a
hand-written copy and a torchrig copy of the same model on the same tokens in interleaved blocks;
the whole comparison runs twice in fresh processes, once with each copy built first, and the
ratio is the geometric mean of the two orders (the copy built first runs a few percent faster on
CPU, whichever it is: ``bench_gpu_sharded.measure``).

B9   FSDP2: ``fully_shard`` per block and at the root with a bf16 ``MixedPrecisionPolicy`` ÷
     ``Accelerator(fsdp_plugin=...)``, tokens/s ratio (worst rank) ≥ 0.98; memory per rank
     (parameters and AdamW state held locally between steps) reported against DDP's full copy.
B10  DeepSpeed ZeRO-3 bf16: ``deepspeed.initialize`` ÷ ``Accelerator(deepspeed_plugin=...)`` ≥ 0.98.

    python benchmarks/bench_sharded_cpu.py [--rounds 10] [--steps 4]
"""

from __future__ import annotations

import argparse
import sys

from _report import emit
from bench_gpu_sharded import measure

GOAL = 0.98
CONFIG = {"layers": 4, "heads": 4, "d": 256, "vocab": 2048, "seq": 128}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds per build order")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    ok_all = True
    for bench_id, strategy in (("B9", "fsdp"), ("B10", "deepspeed")):
        results = measure(strategy, CONFIG, 4, args.rounds, args.steps, False, 2)
        ratio = min(r["ratio"] for r in results)
        ok = ratio >= GOAL
        ok_all = ok_all and ok
        print(f"{bench_id} {strategy}, 2 CPU ranks, 2 build orders × {args.rounds} interleaved rounds × "
              f"{args.steps} steps")
        for rank, r in enumerate(results):
            print(f"  rank {rank}: hand-written {r['hand']:,.0f} tokens/s, torchrig {r['rig']:,.0f} tokens/s, "
                  f"ratio {r['ratio']:.3f} (hand-written built first {r['orders'][0]:.3f}, torchrig built "
                  f"first {r['orders'][1]:.3f})")
        memory = ""
        if results[0]["local_bytes"] is not None:
            local = max(r["local_bytes"] for r in results)
            memory = f"; state per rank {local / 1e6:.1f} MB vs DDP {results[0]['replicated_bytes'] / 1e6:.1f} MB"
            print(f"  parameters + AdamW state per rank between steps: {local / 1e6:.1f} MB (DDP holds "
                  f"{results[0]['replicated_bytes'] / 1e6:.1f} MB on every rank)")
        print(f"{bench_id} ratio (worst rank) {ratio:.3f} (goal ≥ {GOAL}): {'PASS' if ok else 'FAIL'}")
        emit(bench_id, f"{strategy} plugin ÷ hand-written tokens/s (small GPT, 2 CPU ranks)",
             f"{ratio:.3f}{memory}", f"≥ {GOAL}", ok)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
