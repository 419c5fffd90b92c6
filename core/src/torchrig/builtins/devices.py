"""Built-in device plugins. Each answers ``torchrig_select_device`` only when its hardware is
available; the plugin host asks them by priority (cuda, mps, cpu)."""

from __future__ import annotations

from typing import Any

import torch

from torchrig.distributed.device import DeviceBackend
from torchrig.host.run import RunContext
from torchrig.plugin.markers import hookimpl


class CPUBackend(DeviceBackend):
    name = "cpu"
    dist_backend = "gloo"

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))


class CUDABackend(DeviceBackend):
    name = "cuda"
    dist_backend = "nccl"

    def __init__(self, index: int) -> None:
        super().__init__(torch.device("cuda", index))
        torch.cuda.set_device(self.device)

    def precision_problem(self, precision: str) -> str | None:
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            return f"{torch.cuda.get_device_name(self.device)} does not support bfloat16; use fp16"
        return None

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def get_rng_state(self) -> Any:
        return torch.cuda.get_rng_state(self.device)

    def set_rng_state(self, state: Any) -> None:
        torch.cuda.set_rng_state(state, self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "gpu": torch.cuda.get_device_name(self.device)}


class MPSBackend(DeviceBackend):
    name = "mps"
    dist_backend = "gloo"

    def __init__(self) -> None:
        super().__init__(torch.device("mps"))

    def manual_seed(self, seed: int) -> None:
        torch.mps.manual_seed(seed)

    def get_rng_state(self) -> Any:
        return torch.mps.get_rng_state()

    def set_rng_state(self, state: Any) -> None:
        torch.mps.set_rng_state(state)

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def empty_cache(self) -> None:
        torch.mps.empty_cache()


class CPUDevice:
    @hookimpl
    def torchrig_select_device(self, run: RunContext) -> DeviceBackend:
        return CPUBackend()


class CUDADevice:
    @hookimpl
    def torchrig_select_device(self, run: RunContext) -> DeviceBackend | None:
        if not torch.cuda.is_available():
            return None
        return CUDABackend(run.cluster.local_rank % torch.cuda.device_count())


class MPSDevice:
    @hookimpl
    def torchrig_select_device(self, run: RunContext) -> DeviceBackend | None:
        if not (torch.backends.mps.is_available() and torch.backends.mps.is_built()):
            return None
        return MPSBackend()
