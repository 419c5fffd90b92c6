"""B5: time from launch to the first all-reduce, `torchrig launch` against `torchrun`.

Both start 2 CPU workers of the same script (init the gloo group, one all-reduce, write the
wall-clock time, exit). Launches alternate (torchrun, torchrig, torchrun, ...) so machine noise
hits both alike; medians over ≥ 10 launches each. Goal: torchrig ÷ torchrun ≤ 1.05.

    python benchmarks/bench_launch.py [--launches 10]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from _report import emit

SCRIPT = """
import os, sys, time, pathlib
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
pathlib.Path(sys.argv[1], f"rank{dist.get_rank()}").write_text(repr(time.time()))
dist.destroy_process_group()
"""


def launch(command: list[str], out: pathlib.Path) -> float:
    for f in out.glob("rank*"):
        f.unlink()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.time()
    subprocess.run(command + [str(out)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                   timeout=300)
    return max(float(f.read_text()) for f in out.glob("rank*")) - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = pathlib.Path(tmp)
        script = tmp_path / "first_allreduce.py"
        script.write_text(SCRIPT)
        out = tmp_path / "out"
        out.mkdir()
        commands = {
            "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                         str(script)],
            "torchrig": [sys.executable, "-m", "torchrig.launch", "--num_processes", "2", "--cpu", "--log_dir",
                         str(tmp_path / "logs"), str(script)],
            "torchrig --tee 0": [sys.executable, "-m", "torchrig.launch", "--num_processes", "2", "--cpu", "--tee", "0",
                                 "--log_dir", str(tmp_path / "logs0"), str(script)],
        }
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.launches):
            for name, command in commands.items():
                times[name].append(launch(command, out))
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratio = medians["torchrig"] / medians["torchrun"]
    print(f"B5 launch to first all-reduce, 2 CPU workers, {args.launches} alternating launches each")
    for name, values in times.items():
        print(f"  {name:<9} median {medians[name]:.2f} s  (min {min(values):.2f}, max {max(values):.2f})")
    ok = ratio <= 1.05
    print(f"B5 torchrig ÷ torchrun = {ratio:.3f} (goal ≤ 1.05): {'PASS' if ok else 'FAIL'}")
    emit("B5", "launch to first all-reduce ÷ torchrun (2 CPU workers)", f"{ratio:.3f}", "≤ 1.05", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
