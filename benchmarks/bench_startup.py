"""B12: time to first step — process start to the first optimizer step done, one process.

Two scripts train the pinned MLP (32→64→64→10, AdamW) on a shuffled ``TensorDataset`` loader,
one hand-written, one through ``Accelerator()`` + ``prepare`` (what a user's script does); each
prints the wall-clock time once its first ``optimizer.step()`` returned. Each round starts both
as fresh ``python`` processes, back to back, in an order that alternates between rounds (the
second start finds a warmer page cache); the result is the median of the per-round ratios
torchrig ÷ hand-written with its bootstrap 95% interval. Goal ≤ 1.05. torchrig's modules are
byte-compiled first, as a wheel install leaves them. Launch to the first collective under
``torchrig launch`` against ``torchrun`` is B5.

    python benchmarks/bench_startup.py [--rounds 16]
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
from bench_launch import byte_compile_torchrig

GOAL = 1.05

COMMON = """
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = DataLoader(TensorDataset(torch.randn(640, 32), torch.randint(0, 10, (640,))), batch_size=64, shuffle=True)
"""

PLAIN = """import time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
""" + COMMON + """
for x, y in loader:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    break
print(repr(time.time()))
"""

TORCHRIG = """import time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchrig import Accelerator

accelerator = Accelerator()
""" + COMMON + """
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for x, y in loader:
    optimizer.zero_grad()
    accelerator.backward(nn.functional.cross_entropy(model(x), y))
    optimizer.step()
    break
print(repr(time.time()))
"""


def first_step(script: pathlib.Path, cwd: pathlib.Path) -> float:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}, "OMP_NUM_THREADS": "1"}
    start = time.time()
    done = subprocess.run([sys.executable, str(script)], check=True, capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)
    return float(done.stdout.strip().splitlines()[-1]) - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    print(f"byte-compiled: {', '.join(byte_compile_torchrig())}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = pathlib.Path(tmp)
        scripts = {"hand-written": tmp_path / "plain.py", "torchrig": tmp_path / "torchrig_train.py"}
        scripts["hand-written"].write_text(PLAIN)
        scripts["torchrig"].write_text(TORCHRIG)
        names = list(scripts)
        for name in names:  # warm the page cache for both
            first_step(scripts[name], tmp_path)
        times: dict[str, list[float]] = {name: [] for name in names}
        for index in range(args.rounds):
            for name in (names if index % 2 == 0 else names[::-1]):
                times[name].append(first_step(scripts[name], tmp_path))
    ratios = [rig / hand for rig, hand in zip(times["torchrig"], times["hand-written"])]
    ratio, (low, high) = statistics.median(ratios), bootstrap_ci(ratios)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"B12 process start to first optimizer step, 1 process, {args.rounds} rounds (order alternating)")
    for name, values in times.items():
        print(f"  {name:<13} median {medians[name]:.3f} s  (min {min(values):.3f}, max {max(values):.3f})")
    ok = ratio <= GOAL
    print(f"B12 torchrig ÷ hand-written = {ratio:.3f} [{low:.3f}, {high:.3f}] (median of per-round ratios) "
          f"(goal ≤ {GOAL}): {'PASS' if ok else 'FAIL'}")
    emit("B12", f"process start to first step ÷ hand-written script (1 process, {args.rounds} rounds)",
         f"{ratio:.3f} [{low:.3f}, {high:.3f}] ({medians['torchrig']:.2f} s vs {medians['hand-written']:.2f} s)",
         f"≤ {GOAL}", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
