"""The benchmark harness itself keeps working (measurements live in benchmarks/, not here)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.mark.multiprocess
def test_gpu_benchmark_code_path_runs_on_the_cpu_and_skips_cleanly_without_a_gpu():
    smoke = subprocess.run([sys.executable, str(BENCH / "bench_gpu.py"), "--cpu-smoke"], capture_output=True,
                           text=True, timeout=300, env=ENV)
    assert smoke.returncode == 0, smoke.stderr
    assert "hand-written" in smoke.stdout and "torchrig" in smoke.stdout and "MFU = tokens/s" in smoke.stdout
    table = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--quick", "--only", "B7"], capture_output=True,
                           text=True, timeout=300, env=ENV)
    assert table.returncode == 0, table.stdout + table.stderr
    row = next(line for line in table.stdout.splitlines() if line.startswith("B7 "))
    import torch

    assert ("skipped" in row) != torch.cuda.is_available(), row


@pytest.mark.multiprocess
def test_sharded_gpu_benchmark_code_path_runs_on_two_cpu_ranks():
    smoke = subprocess.run([sys.executable, str(BENCH / "bench_gpu_sharded.py"), "--cpu-smoke", "--strategies", "fsdp"],
                           capture_output=True, text=True, timeout=600, env=ENV)
    assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-3000:]
    assert "fsdp: 2 rank(s); torchrig" in smoke.stdout and "B8 CPU smoke run finished" in smoke.stdout


@pytest.mark.multiprocess
def test_fp8_benchmark_code_path_runs_on_the_cpu_and_skips_cleanly_without_a_capable_gpu():
    smoke = subprocess.run([sys.executable, str(BENCH / "bench_fp8.py"), "--cpu-smoke"], capture_output=True,
                           text=True, timeout=300, env=ENV)
    assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-3000:]
    for runner in ("torchrig bf16", "torchrig fp8", "hand-written fp8"):
        assert runner in smoke.stdout, smoke.stdout
    assert "FLOPs/token = 6·N + 12·L·d·T" in smoke.stdout and "B16/B17 CPU smoke run finished" in smoke.stdout
    table = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--quick", "--only", "B16,B17"],
                           capture_output=True, text=True, timeout=300, env=ENV)
    assert table.returncode == 0, table.stdout + table.stderr
    rows = [line for line in table.stdout.splitlines() if line.startswith(("B16 ", "B17 "))]
    import torch

    capable = torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)
    assert len(rows) == 2 and all(("skipped" in row) != capable for row in rows), rows


@pytest.mark.multiprocess
def test_mesh_benchmark_runs_both_cpu_rows_and_skips_the_gpu_row_cleanly():
    table = subprocess.run([sys.executable, str(BENCH / "run_all.py"), "--quick", "--only", "B13"], capture_output=True,
                           text=True, timeout=600, env=ENV)
    rows = {line.split()[0]: line for line in table.stdout.splitlines() if line[:4] in ("B13 ", "B14 ", "B15 ")}
    assert set(rows) == {"B13", "B14", "B15"}, table.stdout[-3000:] + table.stderr[-3000:]
    assert "did not finish" not in table.stdout
    assert "FSDP2×TP ÷ hand-written FSDP2×TP" in rows["B14"] and "TP ÷ hand-written TP" in rows["B13"]
    import torch

    assert ("skipped" in rows["B15"]) != (torch.cuda.device_count() >= 2), rows["B15"]
    # the GPU row's own code path (bf16 policies on both sides) on CPU ranks
    smoke = subprocess.run([sys.executable, str(BENCH / "bench_mesh.py"), "--cpu-smoke"], capture_output=True,
                           text=True, timeout=600, env=ENV)
    assert smoke.returncode == 0 and "B15 CPU smoke run finished" in smoke.stdout, smoke.stdout[-3000:] + smoke.stderr[-3000:]


@pytest.mark.multiprocess
def test_hf_llama_benchmark_runs_its_code_path_on_a_tiny_llama_and_skips_the_gpu_row_cleanly():
    """B20's code path (a transformers Llama from its own plan through torchrig, and the hand-written
    parallelize_module + fully_shard, over prepared and plain loaders) on 4 CPU ranks, FSDP2×TP (the TP row's path
    plus fully_shard): one trial, one round, a tiny model — not a measurement."""
    smoke = subprocess.run([sys.executable, str(BENCH / "bench_hf_llama.py"), "--smoke", "--only", "B20-FSDP2xTP,B20-GPU",
                            "--trials", "1", "--rounds", "1"], capture_output=True, text=True, timeout=600, env=ENV)
    assert smoke.returncode == 0, smoke.stdout[-3000:] + smoke.stderr[-3000:]
    assert "B20 FSDP2×TP smoke: ratio" in smoke.stdout and "B20 smoke run finished" in smoke.stdout, smoke.stdout
    assert "rank 3: hand-written" in smoke.stdout  # all four ranks trained both sides
    assert "B20 GPU skipped: run it with --device cuda" in smoke.stdout  # the GPU row is a run of its own
    sys.path.insert(0, str(BENCH))
    try:
        from run_all import BENCHMARKS
    finally:
        sys.path.remove(str(BENCH))
    assert (("B20", "B20 FSDP2×TP", "B20 GPU"), "bench_hf_llama.py") in [(ids, script) for ids, script, *_ in BENCHMARKS]


def test_the_table_orders_rows_by_number_with_sub_rows_after_their_row():
    sys.path.insert(0, str(BENCH))
    try:
        from run_all import _row_order
    finally:
        sys.path.remove(str(BENCH))
    ids = ["B10", "B1 monitor", "B2", "B1", "B16"]
    assert [i for i in sorted(ids, key=lambda i: _row_order({"id": i}))] == ["B1", "B1 monitor", "B2", "B10", "B16"]
