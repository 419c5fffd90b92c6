"""The built-in precision and device plugins pass their contracts (torchrig.testing.contracts).

Hardware-bound subclasses (cuda, mps) check here that their plugin declines without the hardware
and skip the rest cleanly; on a machine with the device they run in full.
"""

from __future__ import annotations

from torchrig.testing.contracts import DeviceContract, PrecisionContract


class TestFullPrecision(PrecisionContract):
    precision = "no"


class TestBF16Precision(PrecisionContract):
    precision = "bf16"
    autocast_dtype = "bfloat16"


class TestFP16Precision(PrecisionContract):
    """fp16 autocast with a dynamic GradScaler: runs on the CPU too (torch's CPU autocast and GradScaler)."""

    precision = "fp16"
    autocast_dtype = "float16"
    scales_loss = True
    checkpoint_files = ("scaler.pt",)


class TestFP16PrecisionOnCUDA(TestFP16Precision):
    device = "cuda"


class TestBF16PrecisionOnCUDA(TestBF16Precision):
    device = "cuda"


class TestCPUDevice(DeviceContract):
    device = "cpu"
    priority = 0


class TestCUDADevice(DeviceContract):
    device = "cuda"
    priority = 100


class TestMPSDevice(DeviceContract):
    device = "mps"
    priority = 50
