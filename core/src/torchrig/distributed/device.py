"""What a device plugin answers with: one device for this process, and how to drive it.

Device plugins (``cpu``, ``cuda``, ``mps`` built in; others third-party) return a
:class:`DeviceBackend` from ``torchrig_select_device``. The core then uses its plain methods;
it never branches on the device's name.
"""

from __future__ import annotations

from typing import Any

import torch


class DeviceBackend:
    """One torch device, its process-group backend and its per-device operations.

    Subclasses override what differs from the CPU defaults below.
    """

    #: The device plugin's name (``"cpu"``, ``"cuda"``...), for reports.
    name: str = "cpu"
    #: The process-group backend for this device (``"gloo"``, ``"nccl"``...).
    dist_backend: str = "gloo"

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @property
    def autocast_device_type(self) -> str:
        """``device_type`` for ``torch.autocast``."""
        return self.device.type

    def precision_problem(self, precision: str) -> str | None:
        """Why this device cannot run ``precision`` (``"no"``, ``"fp16"``, ``"bf16"``), or None."""
        return None

    def manual_seed(self, seed: int) -> None:
        """Seed this device's generators (the CPU generator is seeded by ``set_seed``)."""

    def get_rng_state(self) -> Any:
        """This device's RNG state, for checkpoints (None when it has none of its own)."""
        return None

    def set_rng_state(self, state: Any) -> None:
        """Restore what :meth:`get_rng_state` returned."""

    def synchronize(self) -> None:
        """Wait for queued work on this device."""

    def empty_cache(self) -> None:
        """Return cached memory to the device (``free_memory``)."""

    def memory_allocated(self) -> int:
        """Bytes currently allocated by tensors on this device (0 where not tracked)."""
        return 0

    def describe(self) -> dict[str, Any]:
        """Facts for ``torchrig env`` and ``--dry-run``."""
        return {"name": self.name, "device": str(self.device), "backend": self.dist_backend}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.device)!r}, backend={self.dist_backend!r})"


__all__ = ["DeviceBackend"]
