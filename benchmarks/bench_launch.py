"""B5: time from launch to the first all-reduce, `torchrig launch` against `torchrun`.

Both start 2 CPU workers of the same script (init the gloo group, one all-reduce, write the
wall-clock time, exit). Each round launches both, back to back, in an order that alternates
between rounds (a launch right after another one finds a warmer page cache), so machine noise
hits both alike. The result is the median of the per-round ratios with its bootstrap 95%
interval (the ratio of the medians is printed beside it); launch-to-launch noise here is about
±0.4 s on ~3 s launches, hence 20 rounds by default. Goal: torchrig ÷ torchrun ≤ 1.05 over
≥ 10 launches each. torchrig's modules are byte-compiled first, as a wheel install leaves them
(:func:`byte_compile_torchrig`). ``--tee0`` adds ``torchrig --tee 0`` (no console tee of worker output).

    python benchmarks/bench_launch.py [--launches 20] [--tee0]
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
from _stats import bootstrap_ci

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


def byte_compile_torchrig() -> list[str]:
    """Byte-compile torchrig and its plugins, as installing a wheel does (torch's modules were
    byte-compiled when pip installed it). An editable install under ``PYTHONDONTWRITEBYTECODE=1``
    (set on these machines) never writes ``.pyc`` files, so every launch would compile the ~170
    modules the launcher imports from source (~100 ms) — a cost of the checkout, not of torchrig."""
    import compileall
    from importlib import metadata, util

    packages = {"torchrig"}
    for dist in metadata.distributions():
        packages.update(ep.module.split(".")[0] for ep in dist.entry_points if ep.group.startswith("torchrig"))
    compiled = []
    for name in sorted(packages):
        spec = util.find_spec(name)
        for location in (spec.submodule_search_locations or []) if spec else []:
            compileall.compile_dir(location, quiet=1)
            compiled.append(name)
    return compiled


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=20, help="rounds; each launches every variant once")
    parser.add_argument("--tee0", action="store_true", help="also time `torchrig launch --tee 0`")
    args = parser.parse_args()
    print(f"byte-compiled: {', '.join(byte_compile_torchrig())}")
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
        }
        if args.tee0:
            commands["torchrig --tee 0"] = [sys.executable, "-m", "torchrig.launch", "--num_processes", "2", "--cpu",
                                            "--tee", "0", "--log_dir", str(tmp_path / "logs0"), str(script)]
        names = list(commands)
        times: dict[str, list[float]] = {name: [] for name in commands}
        for index in range(args.launches):
            for name in (names if index % 2 == 0 else names[::-1]):
                times[name].append(launch(commands[name], out))
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = [rig / run for rig, run in zip(times["torchrig"], times["torchrun"])]
    ratio = statistics.median(ratios)
    low, high = bootstrap_ci(ratios)
    print(f"B5 launch to first all-reduce, 2 CPU workers, {args.launches} rounds (order alternating)")
    for name, values in times.items():
        print(f"  {name:<16} median {medians[name]:.2f} s  (min {min(values):.2f}, max {max(values):.2f})")
    ok = ratio <= 1.05
    print(f"B5 torchrig ÷ torchrun = {ratio:.3f} [{low:.3f}, {high:.3f}] (median of per-round ratios; ratio of "
          f"medians {medians['torchrig'] / medians['torchrun']:.3f}) (goal ≤ 1.05): {'PASS' if ok else 'FAIL'}")
    emit("B5", f"launch to first all-reduce ÷ torchrun (2 CPU workers, {args.launches} rounds)",
         f"{ratio:.3f} [{low:.3f}, {high:.3f}] ({medians['torchrig']:.2f} s vs {medians['torchrun']:.2f} s)",
         "≤ 1.05", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
