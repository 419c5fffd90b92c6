"""B9 and B10: the fsdp and deepspeed plugins ÷ hand-written equivalents on 2 CPU processes.

The CPU counterpart of B8 (same script pieces, ``bench_gpu_sharded.py``): a small GPT (4 layers,
d=256, sequence 128, ~3.7M parameters), batch 4 per rank, 2 ranks over gloo. Each trial starts
fresh worker processes, builds ``--copies`` hand-written and as many torchrig copies of the same
model (alternately; the side built first alternates between trials) and trains them on the same
tokens in interleaved blocks. On this CPU where a copy lands in memory moves its speed by several
percent (see ``bench_gpu_sharded.measure``), so the ratio is the geometric mean over ``--trials``
independent trials, printed with every trial's ratio. ``--control`` builds hand-written copies
on both sides: the A/A noise floor of the same procedure.

B9   FSDP2: ``fully_shard`` per block and at the root with a bf16 ``MixedPrecisionPolicy`` ÷
     ``Accelerator(fsdp_plugin=...)``, tokens/s ratio (worst rank) ≥ 0.98; memory per rank
     (parameters and AdamW state held locally between steps) reported against DDP's full copy.
B10  DeepSpeed ZeRO-3 bf16: ``deepspeed.initialize`` ÷ ``Accelerator(deepspeed_plugin=...)`` ≥ 0.98.

    python benchmarks/bench_sharded_cpu.py [--trials 4] [--copies 8] [--rounds 4] [--steps 2] [--control]
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
    parser.add_argument("--trials", type=int, default=4, help="independent trials, each in fresh processes")
    parser.add_argument("--copies", type=int, default=8, help="copies of each side per trial")
    parser.add_argument("--rounds", type=int, default=4, help="interleaved rounds per trial")
    parser.add_argument("--steps", type=int, default=2, help="training steps per block")
    parser.add_argument("--strategies", default="fsdp,deepspeed")
    parser.add_argument("--control", action="store_true",
                        help="A/A: hand-written copies on both sides (the comparison's noise floor; no goal)")
    args = parser.parse_args()
    wanted = {s.strip() for s in args.strategies.split(",") if s.strip()}
    unknown = wanted - {"fsdp", "deepspeed"}
    if unknown:
        parser.error(f"--strategies: unknown {', '.join(sorted(unknown))}; choose from fsdp, deepspeed")
    ok_all = True
    for bench_id, strategy in (("B9", "fsdp"), ("B10", "deepspeed")):
        if strategy not in wanted:
            continue
        results = measure(strategy, CONFIG, 4, args.rounds, args.steps, False, 2, trials=args.trials,
                          copies=args.copies, control=args.control)
        worst = min(results, key=lambda r: r["ratio"])
        ratio = worst["ratio"]
        ok = ratio >= GOAL
        ok_all = ok_all and ok
        print(f"{bench_id} {strategy}{' A/A control' if args.control else ''}, 2 CPU ranks, {args.trials} trials × "
              f"{args.copies} copies per side × {args.rounds} interleaved rounds × {args.steps} steps")
        for rank, r in enumerate(results):
            print(f"  rank {rank}: hand-written {r['hand']:,.0f} tokens/s, torchrig {r['rig']:,.0f} tokens/s, "
                  f"ratio {r['ratio']:.3f} (geometric mean of trials "
                  f"{' '.join(f'{t:.3f}' for t in r['trials'])})")
        if args.control:
            print(f"{bench_id} A/A control ratio (worst rank) {ratio:.3f}: the noise floor, no goal")
            continue
        memory = ""
        if results[0]["local_bytes"] is not None:
            local = max(r["local_bytes"] for r in results)
            memory = f"; state per rank {local / 1e6:.1f} MB vs DDP {results[0]['replicated_bytes'] / 1e6:.1f} MB"
            print(f"  parameters + AdamW state per rank between steps: {local / 1e6:.1f} MB (DDP holds "
                  f"{results[0]['replicated_bytes'] / 1e6:.1f} MB on every rank)")
        print(f"{bench_id} ratio (worst rank) {ratio:.3f} (goal ≥ {GOAL}): {'PASS' if ok else 'FAIL'}")
        emit(bench_id, f"{strategy} plugin ÷ hand-written tokens/s (small GPT, 2 CPU ranks, {args.trials} trials)",
             f"{ratio:.3f} (trials {' '.join(f'{t:.3f}' for t in worst['trials'])}){memory}", f"≥ {GOAL}", ok)
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
