"""What the hardware can do, as data: GPU kinds (:class:`GpuSpec`) and inter-node networks
(:class:`Interconnect`), the figures the step-time roofline (:mod:`torchrig.estimate.step_time`) and
the throughput monitor's MFU (:mod:`torchrig.tracking.throughput`) divide by.

Torch-free: ``torchrig plan`` and the CLI read these tables without importing torch. Every figure is a
vendor datasheet's (the source is beside each entry): dense peaks (no 2:4 sparsity), HBM bandwidth,
and the intra-node link's bandwidth *per GPU per direction* (NVLink's datasheet figure is both
directions together, e.g. H100 SXM 900 GB/s = 450 GB/s each way). Rates are decimal, as datasheets
state them (1 GB/s = 1e9 B/s, 1 TFLOP/s = 1e12); memory sizes are binary: a marketed "80GB" is 80 GiB of
which torch reports 79.2 GiB on an H100 (the driver reserves the rest).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

#: The precision columns of a peak table, fastest first.
PRECISIONS = ("fp8", "bf16", "fp16", "tf32", "fp32")

GB = 10 ** 9
GIB = 2 ** 30
TERA = 1e12

# Per-hop latency of one ring step, NCCL's own cost model (NVIDIA/nccl src/graph/tuning.cc, hwLat for
# Ring/Simple, the protocol of the large transfers a training step makes: NVLink 3.4 µs, PCIe 5.7 µs,
# network 9.6 µs); NCCL adds a base latency per collective (baseLat Ring/Simple 8.4 µs).
NVLINK_HOP_S = 3.4e-6
PCIE_HOP_S = 5.7e-6
NETWORK_HOP_S = 9.6e-6
COLLECTIVE_BASE_S = 8.4e-6


@attrs.frozen
class GpuSpec:
    """One GPU kind: memory, dense peak FLOP/s per precision, HBM bandwidth, and the intra-node link
    each GPU talks to the others of its node through (per GPU, per direction)."""

    name: str
    memory_bytes: int
    peak_flops: Mapping[str, float]
    hbm_bytes_per_s: float
    link_bytes_per_s: float
    link_name: str
    link_hop_latency_s: float
    source: str

    def peak_flops_for(self, precision: str) -> float:
        """Dense peak FLOP/s in ``precision`` (``bf16``...); a clear error when the GPU has no such rate
        (fp8 on an A100, bf16 on a V100)."""
        if precision not in self.peak_flops:
            raise ValueError(f"GPU {self.name!r} has no {precision!r} tensor-core rate in its datasheet; "
                             f"it has: {', '.join(self.peak_flops)} (choose one of those precisions or another GPU)")
        return self.peak_flops[precision]

    def as_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "peak_flops": dict(self.peak_flops)}


def _peaks(fp8: float | None, bf16: float | None, fp16: float, tf32: float | None, fp32: float) -> dict[str, float]:
    """A peak table in TFLOP/s → FLOP/s, leaving out the precisions the GPU has no rate for."""
    table = {"fp8": fp8, "bf16": bf16, "fp16": fp16, "tf32": tf32, "fp32": fp32}
    return {precision: value * TERA for precision, value in table.items() if value is not None}


def _gpu(name: str, memory_gb: float, peaks: dict[str, float], hbm_gb_s: float, link_gb_s: float, link_name: str,
         hop_s: float, source: str) -> GpuSpec:
    return GpuSpec(name=name, memory_bytes=int(memory_gb * GIB), peak_flops=peaks, hbm_bytes_per_s=hbm_gb_s * GB,
                   link_bytes_per_s=link_gb_s * GB, link_name=link_name, link_hop_latency_s=hop_s, source=source)


_H100_DATASHEET = "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet (H100)"
_HOPPER_PEAKS = _peaks(fp8=1978.9, bf16=989.4, fp16=989.4, tf32=494.7, fp32=66.9)

#: Every GPU kind the plan and the throughput monitor know, by canonical name.
GPUS: dict[str, GpuSpec] = {spec.name: spec for spec in (
    # H100 SXM5 80GB: HBM3 3.35 TB/s, NVLink 4 900 GB/s (both directions).
    _gpu("h100-sxm", 80, _HOPPER_PEAKS, 3350, 450, "nvlink4", NVLINK_HOP_S, _H100_DATASHEET),
    # H100 PCIe 80GB: HBM2e 2.0 TB/s; an NVLink bridge joins pairs only, so a node-wide ring runs over
    # PCIe Gen5 x16 (64 GB/s each way).
    _gpu("h100-pcie", 80, _peaks(fp8=1513, bf16=756.5, fp16=756.5, tf32=378, fp32=51.2), 2000, 64, "pcie-gen5",
         PCIE_HOP_S, _H100_DATASHEET),
    # H100 NVL 94GB: HBM3 3.9 TB/s; bridged in pairs, node-wide rings over PCIe Gen5 x16.
    _gpu("h100-nvl", 94, _peaks(fp8=1670.5, bf16=835.2, fp16=835.2, tf32=417.6, fp32=60.0), 3900, 64, "pcie-gen5",
         PCIE_HOP_S, _H100_DATASHEET),
    # H200 SXM 141GB: HBM3e 4.8 TB/s, NVLink 4 900 GB/s, Hopper's tensor cores.
    _gpu("h200", 141, _HOPPER_PEAKS, 4800, 450, "nvlink4", NVLINK_HOP_S,
         "https://www.nvidia.com/en-us/data-center/h200/"),
    # B200 (HGX B200, per GPU): 180 GB HBM3e 8 TB/s, NVLink 5 1.8 TB/s (both directions); dense = half the
    # sparse figures the datasheet leads with.
    _gpu("b200", 180, _peaks(fp8=4500, bf16=2250, fp16=2250, tf32=1100, fp32=80), 8000, 900, "nvlink5", NVLINK_HOP_S,
         "https://www.nvidia.com/en-us/data-center/hgx/ (HGX B200)"),
    # A100 SXM4: 40GB HBM2 1555 GB/s / 80GB HBM2e 2039 GB/s, NVLink 3 600 GB/s (both directions); no fp8.
    _gpu("a100-40gb", 40, _peaks(fp8=None, bf16=312, fp16=312, tf32=156, fp32=19.5), 1555, 300, "nvlink3",
         NVLINK_HOP_S, "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                       "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    _gpu("a100-80gb", 80, _peaks(fp8=None, bf16=312, fp16=312, tf32=156, fp32=19.5), 2039, 300, "nvlink3",
         NVLINK_HOP_S, "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                       "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    # L40S: 48 GB GDDR6 864 GB/s, no NVLink: PCIe Gen4 x16 (32 GB/s each way).
    _gpu("l40s", 48, _peaks(fp8=733, bf16=362.05, fp16=362.05, tf32=183, fp32=91.6), 864, 32, "pcie-gen4",
         PCIE_HOP_S, "https://www.nvidia.com/en-us/data-center/l40s/"),
    # L4: 24 GB GDDR6 300 GB/s, PCIe Gen4 x16.
    _gpu("l4", 24, _peaks(fp8=242.5, bf16=121, fp16=121, tf32=60, fp32=30.3), 300, 32, "pcie-gen4", PCIE_HOP_S,
         "https://www.nvidia.com/en-us/data-center/l4/"),
    # A10G (AWS G5): 24 GB GDDR6 600 GB/s, PCIe Gen4 x16; no fp8.
    _gpu("a10g", 24, _peaks(fp8=None, bf16=70, fp16=70, tf32=35, fp32=31.2), 600, 32, "pcie-gen4", PCIE_HOP_S,
         "https://aws.amazon.com/ec2/instance-types/g5/ (NVIDIA A10G)"),
    # V100 SXM2 32GB: HBM2 900 GB/s, NVLink 2 300 GB/s (both directions); fp16 tensor cores only.
    _gpu("v100", 32, _peaks(fp8=None, bf16=None, fp16=125, tf32=None, fp32=15.7), 900, 150, "nvlink2", NVLINK_HOP_S,
         "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf"),
    # AMD Instinct MI300X: 192 GB HBM3 5.3 TB/s, Infinity Fabric 7 links x 64 GB/s each way to the other 7 GPUs.
    _gpu("mi300x", 192, _peaks(fp8=2614.9, bf16=1307.4, fp16=1307.4, tf32=653.7, fp32=163.4), 5300, 448,
         "infinity-fabric", NVLINK_HOP_S,
         "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"),
)}

#: Other spellings :func:`gpu_spec` accepts.
GPU_ALIASES = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h200-sxm": "h200", "a100": "a100-80gb",
               "a100-sxm": "a100-80gb", "a100-80g": "a100-80gb", "a100-40g": "a100-40gb", "mi300": "mi300x",
               "v100-sxm2": "v100", "l40-s": "l40s"}

#: Dense peak FLOP/s by GPU and precision (the throughput monitor's MFU table, keyed as
#: :func:`torchrig.tracking.throughput.gpu_table_key` names a CUDA device: ``a100`` is either A100).
PEAK_FLOPS: dict[str, dict[str, float]] = {name: dict(spec.peak_flops) for name, spec in GPUS.items()}
PEAK_FLOPS["a100"] = dict(GPUS["a100-80gb"].peak_flops)


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _lookup(what: str, name: str, table: Mapping[str, Any], aliases: Mapping[str, str]) -> Any:
    """``table``'s entry for ``name`` (canonical or an alias, any case), or an error naming the known ones."""
    key = _normalise(name)
    key = aliases.get(key, key)
    if key not in table:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(table)} (aliases: {', '.join(sorted(aliases))})")
    return table[key]


def gpu_spec(name: str) -> GpuSpec:
    """The :class:`GpuSpec` of ``name`` (canonical or an alias, any case: ``"H100"`` → h100-sxm)."""
    return _lookup("GPU kind", name, GPUS, GPU_ALIASES)


@attrs.frozen
class Interconnect:
    """An inter-node network: its bandwidth per direction, either per GPU (a NIC per GPU, as on
    InfiniBand/RoCE rails) or per node (shared by the node's GPUs: EFA's 3200 Gb/s per 8-GPU instance,
    one Ethernet NIC), and the latency of one hop."""

    name: str
    bits_per_s: float
    per: str  # "gpu" or "node"
    hop_latency_s: float
    source: str

    def __attrs_post_init__(self) -> None:
        if self.per not in ("gpu", "node"):
            raise ValueError(f"interconnect {self.name!r}: per must be 'gpu' or 'node', got {self.per!r}")

    def bytes_per_s_per_gpu(self, gpus_per_node: int) -> float:
        """What one GPU can send each way across nodes, with ``gpus_per_node`` GPUs sharing a node's NICs."""
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        per_gpu = self.bits_per_s / 8
        return per_gpu if self.per == "gpu" else per_gpu / gpus_per_node

    def as_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


#: Every inter-node network the plan knows, by name.
INTERCONNECTS: dict[str, Interconnect] = {net.name: net for net in (
    # InfiniBand NDR, one ConnectX-7 (400 Gb/s) per GPU, as in DGX H100 / HGX H100 rails.
    Interconnect("ib-ndr-400", 400e9, "gpu", NETWORK_HOP_S,
                 "https://www.nvidia.com/en-us/networking/infiniband-adapters/ (ConnectX-7 NDR 400Gb/s)"),
    # InfiniBand HDR, one 200 Gb/s HCA per GPU, as in DGX A100.
    Interconnect("ib-hdr-200", 200e9, "gpu", NETWORK_HOP_S,
                 "https://www.nvidia.com/en-us/networking/infiniband-adapters/ (ConnectX-6 HDR 200Gb/s)"),
    # RoCE v2 at 400 Gb/s per GPU (e.g. Meta's Grand Teton RDMA backend, torchtitan's benchmark hosts).
    Interconnect("roce-400", 400e9, "gpu", NETWORK_HOP_S,
                 "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"),
    # AWS EFA v2 on p5.48xlarge: 3200 Gb/s per instance of 8 H100s.
    Interconnect("efa-v2", 3200e9, "node", NETWORK_HOP_S, "https://aws.amazon.com/ec2/instance-types/p5/"),
    # AWS EFA on p4d.24xlarge: 400 Gb/s per instance of 8 A100s.
    Interconnect("efa-v1", 400e9, "node", NETWORK_HOP_S, "https://aws.amazon.com/ec2/instance-types/p4/"),
    # Plain 100 Gb Ethernet, one NIC per node (TCP or RoCE).
    Interconnect("ethernet-100", 100e9, "node", NETWORK_HOP_S, "one 100GbE NIC per node"),
)}

INTERCONNECT_ALIASES = {"ib": "ib-ndr-400", "ndr": "ib-ndr-400", "hdr": "ib-hdr-200", "efa": "efa-v2",
                        "roce": "roce-400", "ethernet": "ethernet-100"}


def interconnect(name: str) -> Interconnect:
    """The :class:`Interconnect` of ``name`` (canonical or an alias, any case)."""
    return _lookup("interconnect", name, INTERCONNECTS, INTERCONNECT_ALIASES)


__all__ = ["COLLECTIVE_BASE_S", "GPUS", "GPU_ALIASES", "INTERCONNECTS", "INTERCONNECT_ALIASES", "NETWORK_HOP_S",
           "NVLINK_HOP_S", "PCIE_HOP_S", "PEAK_FLOPS", "PRECISIONS", "GpuSpec", "Interconnect", "gpu_spec",
           "interconnect"]
