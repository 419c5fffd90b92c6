"""``torchrig env``: the facts a bug report needs — what ``accelerate env`` shows (versions, RAM, the
default config file and its contents) plus torchrig's plugins, devices and relevant variables.

It imports neither torch nor any library it reports: versions come from the installed packages'
metadata and the devices from the device plugins' torch-free answers (``torchrig plugins``), so it
answers in well under a second where importing torch and its distributed backends took ~12 s.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import pathlib
import platform
import shutil
import sys
from typing import Any

import yaml

from torchrig._version import __version__
from torchrig.builtins.device_presence import cuda_absence, torch_build
from torchrig.cli.plugins import listing
from torchrig.config.resolve import accelerate_default_config_path, default_config_path
from torchrig.host.discovery import installed_distributions, normalize_distribution_name
from torchrig.host.plugin_host import PluginHost

#: Environment variables that change how torchrig, torch.distributed or Hugging Face libraries behave.
_RELEVANT_ENV_PREFIXES = ("TORCHRIG_", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "NCCL_", "MASTER_", "DS_ACCELERATOR",
                          "HF_HOME", "ACCELERATE_", "XDG_CACHE_HOME")
#: Libraries whose versions ``accelerate env`` and bug reports ask for (read from metadata, never imported).
LIBRARIES = ("numpy", "pluggy", "attrs", "PyYAML", "safetensors", "transformers", "accelerate", "deepspeed", "torchao",
             "tensorboard", "wandb", "mlflow")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _ram_gb() -> float | None:
    """Total memory in GiB (``accelerate env``'s "System RAM"), without psutil."""
    try:
        with open("/proc/meminfo") as meminfo:  # Linux: what psutil reports
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024**2, 2)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3, 2)
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None


def _nvidia_gpus(root: pathlib.Path = pathlib.Path("/proc/driver/nvidia/gpus")) -> list[str]:
    """The GPU models the NVIDIA driver lists (Linux), read from its files instead of initialising CUDA."""
    models = []
    for info in sorted(root.glob("*/information")) if root.is_dir() else ():
        for line in info.read_text(errors="replace").splitlines():
            if line.startswith("Model:"):
                models.append(line.partition(":")[2].strip())
    return models


def _config_file(path: pathlib.Path) -> dict[str, Any]:
    """A default config file's path and contents (None: no such file; text: it does not parse)."""
    if not path.is_file():
        return {"path": str(path), "contents": None}
    text = path.read_text(errors="replace")
    try:
        contents = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        contents = f"does not parse as YAML ({exc})"
    return {"path": str(path), "contents": contents}


def collect(config_file: str | None = None) -> dict[str, Any]:
    """``config_file``: a run's config file to show too (``accelerate env --config_file``)."""
    build = torch_build() or {}
    info: dict[str, Any] = {
        "torchrig": __version__,
        "torchrig_location": shutil.which("torchrig") or "not found",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "ram_gb": _ram_gb(),
        "torch": _version("torch") or "not installed",
        "cuda_version": build.get("cuda"),
        "cuda_available": cuda_absence() is None,
        "gpus": _nvidia_gpus(),
    }
    info["devices"] = {str(row["name"]): row["status"] if not row.get("reason") else f"{row['status']}: {row['reason']}"
                       for row in listing(PluginHost(), "device")}
    info["plugin_distributions"] = {
        dist.metadata["Name"]: dist.version
        for dist in installed_distributions()
        if normalize_distribution_name(dist.metadata["Name"]).startswith("torchrig")
    }
    info["libraries"] = {name: _version(name) for name in LIBRARIES}
    info["default_config"] = _config_file(default_config_path())
    info["accelerate_default_config"] = _config_file(accelerate_default_config_path())
    if config_file is not None:
        info["config_file"] = _config_file(pathlib.Path(config_file))
    info["environment"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_RELEVANT_ENV_PREFIXES)}
    return info


def run_env(*, as_json: bool, config_file: str | None = None) -> int:
    info = collect(config_file)
    if as_json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    for key, value in info.items():
        if key in ("default_config", "accelerate_default_config", "config_file"):
            print(f"{key}: {value['path']}" + ("" if value["contents"] is not None else " (not found)"))
            _print_nested(value["contents"], "  ")
        else:
            _print_nested({key: value}, "")
    return 0


def _print_nested(value: Any, indent: str) -> None:
    if isinstance(value, dict):
        for sub_key, sub_value in value.items():
            if isinstance(sub_value, dict) and sub_value:
                print(f"{indent}{sub_key}:")
                _print_nested(sub_value, indent + "  ")
            else:
                print(f"{indent}{sub_key}: {sub_value}")
    elif value is not None:
        print(f"{indent}{value}")


__all__ = ["LIBRARIES", "collect", "run_env"]
