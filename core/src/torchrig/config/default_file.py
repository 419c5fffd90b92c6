"""The machine's default config file: what ``torchrig config`` (and Accelerate's
``write_basic_config``) write there, validated exactly as a config file is read."""

from __future__ import annotations

import os
import pathlib
import tempfile
from typing import Any

import yaml

from torchrig.config.resolve import default_config_path, resolve_config
from torchrig.host.plugin_host import PluginHost, PluginStatus


def default_distributed_strategy(host: PluginHost) -> str | None:
    """The installed strategy that serves jobs of several processes by default (DDP), or None."""
    for info in host.plugins("strategy"):
        if info.manifest is not None and info.manifest.default_for_distributed and info.status is PluginStatus.AVAILABLE:
            return info.name
    return None


def detect_defaults(host: PluginHost) -> dict[str, Any]:
    """What ``accelerate config default`` would write, from the hardware torch sees."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    answers: dict[str, Any] = {"mixed_precision": "no", "use_cpu": gpus == 0, "num_machines": 1,
                               "num_processes": max(gpus, 1)}
    distributed = default_distributed_strategy(host)
    answers["strategy"] = distributed if gpus > 1 and distributed else "single"
    if answers["strategy"] == "single":
        answers["num_processes"] = 1
    return answers


def write_config_file(host: PluginHost, answers: dict[str, Any], target: pathlib.Path) -> None:
    """Validate ``answers`` as a config file would be (a ``ConfigError`` lists every problem),
    then write them to ``target`` atomically."""
    text = yaml.safe_dump(answers, sort_keys=False)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".default_config.", suffix=".yaml", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        resolve_config(host, config_file=tmp, default_file=False, environ={}, flags={}, warn=False)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_basic_config(mixed_precision: str = "no", save_location: str | os.PathLike[str] | None = None,
                       use_xpu: bool = False) -> pathlib.Path | bool:
    """Accelerate's ``write_basic_config``: the default file for this machine's hardware with
    ``mixed_precision``, written to ``save_location`` (default: the machine's default file) —
    unless a file is already there (then nothing is written and False returned, as in Accelerate).
    Returns the path written."""
    if use_xpu:
        raise ValueError("write_basic_config(use_xpu=True): Intel XPU devices are not supported (no xpu device plugin)")
    target = pathlib.Path(save_location) if save_location is not None else default_config_path()
    if target.exists():
        print(f"configuration already exists at {target}, not overwritten: run `torchrig config` or pass another "
              "save_location")
        return False
    host = PluginHost()
    write_config_file(host, {**detect_defaults(host), "mixed_precision": str(mixed_precision).lower()}, target)
    return target


__all__ = ["default_distributed_strategy", "detect_defaults", "write_basic_config", "write_config_file"]
