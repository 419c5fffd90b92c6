"""Whether the built-in device plugins' hardware is present, answered without importing torch.

``torchrig plugins`` must stay torch-free (importing torch costs seconds), yet must not list a
device as available on a machine without it. So the answers come from what torch's build
records (``torch/version.py``, read as text) and from the device nodes a driver creates. They
are a listing's answer, cheap and conservative: where they cannot tell (another OS), they say
nothing, and a run's device selection still asks torch itself.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pathlib
import sys
from collections.abc import Mapping

NO_CUDA_DEVICE = "no CUDA device visible"


def _torch_dir() -> pathlib.Path | None:
    spec = importlib.util.find_spec("torch")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return pathlib.Path(locations[0]) if locations else None


def torch_build(torch_dir: pathlib.Path | None = None) -> dict[str, object] | None:
    """The constants of ``torch/version.py`` (``__version__``, ``cuda``, ``hip``), parsed, not imported."""
    torch_dir = torch_dir or _torch_dir()
    try:
        tree = ast.parse((torch_dir / "version.py").read_text()) if torch_dir else None
    except (OSError, SyntaxError):
        return None
    if tree is None:
        return None
    values: dict[str, object] = {}
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and node.value is not None:
            try:
                values[target.id] = ast.literal_eval(node.value)
            except ValueError:
                continue
    return values


def _has_device_node(dev_dir: pathlib.Path, prefixes: tuple[str, ...]) -> bool:
    try:
        names = os.listdir(dev_dir)
    except OSError:
        return False
    return any(name == prefix or (name.startswith(prefix) and name[len(prefix):].isdigit())
               for name in names for prefix in prefixes)


def cuda_absence(*, torch_dir: pathlib.Path | None = None, dev_dir: pathlib.Path | str = "/dev",
                 environ: Mapping[str, str] | None = None) -> str | None:
    """Why no CUDA (or ROCm, which torch serves as ``cuda``) device can be used here, or None."""
    environ = os.environ if environ is None else environ
    build = torch_build(torch_dir)
    if build is None:
        return "torch is not installed" if (torch_dir or _torch_dir()) is None else None
    if build.get("cuda") is None and build.get("hip") is None:
        return f"torch {build.get('__version__', '')} is built without CUDA"
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and (visible.strip() == "" or visible.strip().startswith("-1")):
        return f"{NO_CUDA_DEVICE} (CUDA_VISIBLE_DEVICES={visible!r} hides every GPU)"
    if not sys.platform.startswith("linux"):
        return None  # no cheap, certain test elsewhere: selection asks torch
    dev_dir = pathlib.Path(dev_dir)
    # NVIDIA's driver creates /dev/nvidia0...; ROCm's /dev/kfd; WSL's GPU paravirtualisation /dev/dxg.
    nodes = ("kfd",) if build.get("cuda") is None else ("nvidia", "dxg")
    if not _has_device_node(dev_dir, nodes):
        return NO_CUDA_DEVICE
    return None


def mps_absence(platform: str | None = None) -> str | None:
    """Why Apple's Metal (MPS) cannot be used here, or None (on macOS torch decides at selection)."""
    platform = sys.platform if platform is None else platform
    return None if platform == "darwin" else "MPS exists only on macOS"


__all__ = ["NO_CUDA_DEVICE", "cuda_absence", "mps_absence", "torch_build"]
