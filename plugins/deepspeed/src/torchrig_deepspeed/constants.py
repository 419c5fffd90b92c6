"""The ``deepspeed`` plugin's names, shared by its manifest (flag choices), its options class, its
checks and its runtime; torch-free and import-free, so the manifest never imports the options class."""

from __future__ import annotations

SECTION = "deepspeed_config"
#: The key of the DeepSpeed JSON (``DeepSpeedPlugin.hf_ds_config``), as problems name it.
DS_KEY = f"{SECTION}.hf_ds_config"
#: The DeepSpeed JSON's placeholder for a value torchrig fills in.
AUTO = "auto"
#: Where ZeRO offloads optimizer state and parameters (``offload_*_device``).
OFFLOAD_DEVICES = ("none", "cpu", "nvme")
#: Accelerate's ZeRO stage when neither ``zero_stage`` (default None: defer to the JSON) nor the
#: JSON names one.
DEFAULT_ZERO_STAGE = 2

__all__ = ["AUTO", "DEFAULT_ZERO_STAGE", "DS_KEY", "OFFLOAD_DEVICES", "SECTION"]
