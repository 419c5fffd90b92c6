"""The GPU and interconnect tables the roofline divides by: lookups, aliases, errors that name the bad
entry, and the throughput monitor reading the same peak table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from torchrig.estimate import hardware
from torchrig.estimate.hardware import GPUS, INTERCONNECTS, PEAK_FLOPS, gpu_spec, interconnect
from torchrig.tracking import throughput

REQUIRED_GPUS = ("h100-sxm", "h100-pcie", "h100-nvl", "h200", "b200", "a100-40gb", "a100-80gb", "l40s", "l4", "a10g",
                 "v100", "mi300x")


def test_the_table_holds_every_gpu_kind_with_consistent_figures():
    assert set(REQUIRED_GPUS) <= set(GPUS)
    for spec in GPUS.values():
        assert spec.memory_bytes >= 16e9 and spec.hbm_bytes_per_s >= 100e9 and spec.link_bytes_per_s >= 16e9, spec
        assert set(spec.peak_flops) <= set(hardware.PRECISIONS) and "fp32" in spec.peak_flops, spec.name
        tensor_core = spec.peak_flops.get("bf16", spec.peak_flops["fp16"])
        assert tensor_core > spec.peak_flops["fp32"], spec.name
        assert spec.source, spec.name


def test_datasheet_figures_of_the_h100_sxm():
    h100 = gpu_spec("h100-sxm")
    assert h100.peak_flops_for("bf16") == pytest.approx(989.4e12)
    assert h100.peak_flops_for("fp8") == pytest.approx(2 * 989.4e12, rel=1e-3)
    assert h100.hbm_bytes_per_s == pytest.approx(3.35e12)
    assert h100.link_bytes_per_s == pytest.approx(450e9)  # NVLink 4: 900 GB/s both ways
    # marketed "80GB" is binary: torch reports 79.2 GiB total on an H100 80GB (the rest is reserved)
    assert h100.memory_bytes == 80 * 2 ** 30


@pytest.mark.parametrize("alias, name", [("h100", "h100-sxm"), ("H100", "h100-sxm"), ("H100_SXM", "h100-sxm"),
                                          ("a100", "a100-80gb"), ("A100-40GB", "a100-40gb"), ("mi300", "mi300x")])
def test_gpu_aliases(alias, name):
    assert gpu_spec(alias).name == name


def test_an_unknown_gpu_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown GPU kind 'h1000'; known: h100-sxm, .*mi300x"):
        gpu_spec("h1000")


def test_a_precision_the_gpu_lacks_is_named_with_the_ones_it_has():
    with pytest.raises(ValueError, match=r"GPU 'a100-80gb' has no 'fp8' .* it has: bf16, fp16, tf32, fp32"):
        gpu_spec("a100").peak_flops_for("fp8")


def test_interconnect_bandwidth_per_gpu():
    assert interconnect("ib-ndr-400").bytes_per_s_per_gpu(8) == pytest.approx(50e9)  # a NIC per GPU
    assert interconnect("efa-v2").bytes_per_s_per_gpu(8) == pytest.approx(50e9)  # 3200 Gb/s per 8-GPU node
    assert interconnect("efa-v2").bytes_per_s_per_gpu(4) == pytest.approx(100e9)
    assert interconnect("ethernet-100").bytes_per_s_per_gpu(8) == pytest.approx(12.5e9 / 8)
    assert interconnect("IB").name == "ib-ndr-400"
    assert {"ib-ndr-400", "ib-hdr-200", "roce-400", "efa-v2", "ethernet-100"} <= set(INTERCONNECTS)


def test_an_unknown_interconnect_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown interconnect 'infiniband-xdr'; known: ib-ndr-400, "):
        interconnect("infiniband-xdr")
    with pytest.raises(ValueError, match="gpus_per_node must be >= 1"):
        interconnect("efa-v2").bytes_per_s_per_gpu(0)


def test_the_throughput_monitor_reads_this_table():
    assert throughput.PEAK_FLOPS is PEAK_FLOPS
    assert throughput.peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == gpu_spec("a100").peak_flops_for("bf16")
    assert throughput.peak_flops("AMD Instinct MI300X", "bf16") == gpu_spec("mi300x").peak_flops_for("bf16")


def test_the_module_is_torch_free():
    tree = ast.parse(Path(hardware.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "torch" not in imported
