"""B4: the cost of `import torchrig` and `torchrig --help`, against `import torch`.

Each command runs in a fresh interpreter; runs of the three commands are interleaved so that
machine noise hits them alike, and medians are compared. Budget: `import torchrig` ≤ 1.05 ×
`import torch`, and `torchrig --help` must not import torch at all.

    python benchmarks/bench_import.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from _report import emit

COMMANDS = {
    "import torch": [sys.executable, "-c", "import torch"],
    "import torchrig": [sys.executable, "-c", "import torchrig"],
    "torchrig --help": [sys.executable, "-m", "torchrig", "--help"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    timings: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, command in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            timings[name].append(time.perf_counter() - start)
    probe = subprocess.run(
        [sys.executable, "-c", ("import sys; from torchrig.cli.main import build_parser; "
                                "build_parser().format_help(); import torchrig; print('torch' in sys.modules)")],
        capture_output=True, text=True, check=True,
    )
    torch_median = statistics.median(timings["import torch"])
    print(f"{'command':<18} {'median ms':>10} {'÷ import torch':>15}")
    for name, values in timings.items():
        median = statistics.median(values)
        print(f"{name:<18} {median * 1e3:>10.1f} {median / torch_median:>15.3f}")
    ratio = statistics.median(timings["import torchrig"]) / torch_median
    imports_torch = probe.stdout.strip() == "True"
    print(f"torchrig --help imports torch: {imports_torch}")
    ok = ratio <= 1.05 and not imports_torch
    print(f"B4 import torchrig ÷ import torch = {ratio:.3f} (budget ≤ 1.05): {'PASS' if ok else 'FAIL'}")
    emit("B4", "import torchrig ÷ import torch; --help without torch",
         f"{ratio:.3f}; torch imported by --help: {imports_torch}", "≤ 1.05; no torch", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
