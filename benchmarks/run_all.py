"""Run every benchmark and print one table: ``python benchmarks/run_all.py``.

Each benchmark runs as its own process (its own interleaving, medians and ratios against a
baseline measured in the same run; see each script's docstring) and reports a summary row;
this script collects the rows. Hugging Face Accelerate and Lightning Fabric appear where they
are installed (``pip install 'torchrig[bench]'``); GPU rows say "skipped" without a CUDA GPU.

    python benchmarks/run_all.py [--quick] [--only B1,B6]

``--quick`` runs fewer rounds (a smoke test of the harness, not a measurement). Exit code 0 when
every measured row meets its goal.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from _report import RESULTS_ENV

HERE = pathlib.Path(__file__).resolve().parent

#: (ids, script, full arguments, quick arguments)
BENCHMARKS = [
    (("B1",), "bench_step_overhead.py", [], ["--rounds", "8", "--steps", "20"]),
    (("B2", "B3"), "bench_ddp.py", [], ["--rounds", "3"]),
    (("B4",), "bench_import.py", [], ["--repeats", "3"]),
    (("B5",), "bench_launch.py", [], ["--launches", "2"]),
    (("B6",), "bench_checkpoint.py", [], ["--rounds", "2"]),
    (("B6 sharded",), "bench_checkpoint_sharded.py", [], ["--rounds", "2"]),
    (("B7",), "bench_gpu.py", [], ["--quick"]),
    (("B9", "B10"), "bench_sharded_cpu.py", [], ["--trials", "2", "--copies", "1", "--rounds", "2", "--steps", "1"]),
    (("B8",), "bench_gpu_sharded.py", [], ["--quick"]),
    (("B11",), "bench_data.py", [], ["--trials", "1", "--rounds", "2", "--cases", "a,d"]),
    (("B12",), "bench_startup.py", [], ["--rounds", "2"]),
    (("B13", "B14", "B15"), "bench_mesh.py", [], ["--trials", "1", "--copies", "1", "--rounds", "2", "--steps", "1"]),
    (("B16", "B17"), "bench_fp8.py", [], ["--quick"]),
    (("B19",), "bench_expert_parallel.py", [], ["--trials", "1", "--copies", "1", "--rounds", "2", "--steps", "1"]),
    (("B19 SAC",), "bench_activation_checkpointing.py", [],
     ["--repeats", "1", "--layers", "2", "--width", "64", "--seq", "32"]),
    (("B20", "B20 FSDP2×TP", "B20 GPU"), "bench_hf_llama.py", [], ["--smoke", "--trials", "1", "--rounds", "1"]),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds: checks the harness, measures nothing")
    parser.add_argument("--only", default="", help="comma-separated ids, e.g. B1,B6")
    args = parser.parse_args()
    wanted = {i.strip().upper() for i in args.only.split(",") if i.strip()}

    fd, results = tempfile.mkstemp(prefix="torchrig-bench-", suffix=".jsonl")
    os.close(fd)
    env = {**os.environ, RESULTS_ENV: results, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    failed_to_run = []
    started = time.time()
    for ids, script, full, quick in BENCHMARKS:
        if wanted and not wanted & set(ids):
            continue
        print(f"\n=== {'/'.join(ids)}: {script}", flush=True)
        code = subprocess.call([sys.executable, str(HERE / script), *(quick if args.quick else full)], env=env, cwd=HERE.parent)
        reported = {json.loads(line)["id"] for line in pathlib.Path(results).read_text().splitlines() if line.strip()}
        if not set(ids) <= reported:  # a crash: no row (exit 1 alone means "ran, missed a goal")
            failed_to_run.append(f"{script} (exit {code}, no result for {', '.join(sorted(set(ids) - reported))})")
    rows = [json.loads(line) for line in pathlib.Path(results).read_text().splitlines() if line.strip()]
    os.unlink(results)

    peers = sorted({name for row in rows for name in row["peers"]})
    print(f"\n{'=' * 100}\ntorchrig benchmarks ({'quick: not a measurement' if args.quick else 'full'}), "
          f"{time.time() - started:.0f} s\n")
    header = ["id", "what", "torchrig", "goal", "status", *peers]
    table = [[row["id"], row["what"], row["value"], row["goal"],
              {True: "met", False: "MISSED", None: "skipped"}[row["ok"]], *(row["peers"].get(p, "—") for p in peers)]
             for row in sorted(rows, key=_row_order)]
    widths = [min(60, max(len(str(r[i])) for r in [header, *table])) for i in range(len(header))]
    for line in [header, ["-" * w for w in widths], *table]:
        print("  ".join(str(cell)[:60].ljust(width) for cell, width in zip(line, widths)))
    for problem in failed_to_run:
        print(f"did not finish: {problem}")
    missed = [row["id"] for row in rows if row["ok"] is False]
    if missed:
        print(f"\ngoals missed: {', '.join(missed)}")
    return 1 if missed or failed_to_run else 0


def _row_order(row: dict) -> tuple[int, str]:
    """B1, B1 monitor, B2, ..., B10: by number, then sub-rows by name."""
    number = "".join(itertools.takewhile(str.isdigit, row["id"][1:]))
    return int(number or 0), row["id"]


if __name__ == "__main__":
    sys.exit(main())
