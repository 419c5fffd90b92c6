"""``torchrig env``: the facts a bug report needs (versions, devices, OS, relevant variables)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import sys
from typing import Any

from torchrig._version import __version__
from torchrig.discovery import installed_distributions, normalize_distribution_name

#: Environment variables that change how torchrig or torch.distributed behave.
_RELEVANT_ENV_PREFIXES = ("TORCHRIG_", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_", "MASTER_", "DS_ACCELERATOR")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def collect() -> dict[str, Any]:
    info: dict[str, Any] = {
        "torchrig": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    info["plugin_distributions"] = {
        dist.metadata["Name"]: dist.version
        for dist in installed_distributions()
        if normalize_distribution_name(dist.metadata["Name"]).startswith("torchrig")
    }
    info["libraries"] = {name: _version(name) for name in ("pluggy", "attrs", "PyYAML", "deepspeed")}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda_available"] = torch.cuda.is_available()
        info["cuda_version"] = torch.version.cuda
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["mps_available"] = bool(torch.backends.mps.is_available())
        info["distributed_backends"] = {
            "gloo": torch.distributed.is_gloo_available(),
            "nccl": torch.distributed.is_nccl_available(),
        }
    except ImportError as exc:
        info["torch"] = f"not importable: {exc}"
    info["environment"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_RELEVANT_ENV_PREFIXES)}
    return info


def run_env(*, as_json: bool) -> int:
    info = collect()
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for key, value in info.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for sub_key, sub_value in value.items():
                print(f"  {sub_key}: {sub_value}")
        else:
            print(f"{key}: {value}")
    return 0
