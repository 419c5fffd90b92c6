"""Environment-variable, process-placement and host checks with Accelerate's names.

Torch-free except where a device must be asked; ``nvidia-smi`` is preferred for GPU facts so that
asking does not initialise CUDA in a process that forks afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
from packaging.version import Version

from torchrig.compat.resolve import module_attributes

_log = logging.getLogger(__name__)

#: The prefix of torchrig's own variables (``TORCHRIG_MIXED_PRECISION``...), which
#: :func:`purge_accelerate_environment` restores.
ENV_PREFIX = "TORCHRIG_"


def str_to_bool(value: str, to_bool: bool = False) -> int | bool:
    """``y/yes/t/true/on/1`` -> 1 (True with ``to_bool``), ``n/no/f/false/off/0`` -> 0; else ValueError."""
    text = value.lower()
    if text in ("y", "yes", "t", "true", "on", "1"):
        return True if to_bool else 1
    if text in ("n", "no", "f", "false", "off", "0"):
        return False if to_bool else 0
    raise ValueError(f"invalid truth value {value!r}")


def get_int_from_env(env_keys: Sequence[str], default: int) -> int:
    """The first non-negative integer among ``env_keys``' values, else ``default``."""
    for key in env_keys:
        value = int(os.environ.get(key, "-1"))
        if value >= 0:
            return value
    return default


def parse_flag_from_env(key: str, default: bool = False) -> bool:
    return str_to_bool(os.environ.get(key, str(default))) == 1


def parse_choice_from_env(key: str, default: str = "no") -> str:
    return os.environ.get(key, str(default))


def are_libraries_initialized(*library_names: str) -> list[str]:
    """Those of ``library_names`` already imported in this process."""
    return [name for name in library_names if name in sys.modules]


def convert_dict_to_env_variables(current_env: Mapping[str, str]) -> list[str]:
    """``KEY=VALUE\\n`` lines for the entries safe to write to an environment file; entries with
    ``; \\n < >`` or a space, or an empty key or value, are skipped with a warning."""
    forbidden = (";", "\n", "<", ">", " ")
    lines = []
    for key, value in current_env.items():
        if key and value and not any(char in key + value for char in forbidden):
            lines.append(f"{key}={value}\n")
        else:
            _log.warning("skipping %s=%s: it contains forbidden characters or is empty", key, value)
    return lines


@contextlib.contextmanager
def clear_environment() -> Iterator[None]:
    """Run the block with an empty ``os.environ``; the previous one is back afterwards."""
    saved = os.environ.copy()
    os.environ.clear()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def patch_environment(**kwargs: Any) -> Iterator[None]:
    """Set ``KEY=str(value)`` (keys upper-cased) for the block; previous values come back after."""
    saved = {key.upper(): os.environ.get(key.upper()) for key in kwargs}
    for key, value in kwargs.items():
        os.environ[key.upper()] = str(value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _restored_prefix(prefix: str) -> Iterator[None]:
    saved = {key: value for key, value in os.environ.items() if key.startswith(prefix)}
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith(prefix)]:
            if key not in saved:
                del os.environ[key]
        os.environ.update(saved)


def purge_accelerate_environment(func_or_cls: Any) -> Any:
    """Decorator: ``TORCHRIG_*`` variables set while the function (or each ``test*`` method of a
    class, subclasses included) runs are removed afterwards, and changed ones restored — so tests
    do not leak configuration into each other."""

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _restored_prefix(ENV_PREFIX):
                return function(*args, **kwargs)

        wrapper._torchrig_purged_environment = True  # type: ignore[attr-defined]
        return wrapper

    if not isinstance(func_or_cls, type):
        return wrap(func_or_cls)

    def wrap_test_methods(cls: type) -> type:
        for name in dir(cls):
            method = getattr(cls, name)
            if name.startswith("test") and callable(method) and not hasattr(method, "_torchrig_purged_environment"):
                setattr(cls, name, wrap(method))
        return cls

    wrap_test_methods(func_or_cls)
    func_or_cls.__init_subclass__ = classmethod(lambda cls, **kwargs: wrap_test_methods(cls))  # type: ignore[misc]
    return func_or_cls


@attrs.frozen
class CPUInformation:
    """Where this process sits, as the launch environment says (torchrun, MPI, MVAPICH)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1


def get_cpu_distributed_information() -> CPUInformation:
    """Rank, world size, local rank and local world size from torchrun's, Intel MPI's, Open MPI's
    or MVAPICH's variables (the first set wins; defaults: one process)."""
    return CPUInformation(
        rank=get_int_from_env(["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"], 0),
        world_size=get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1),
        local_rank=get_int_from_env(["LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK",
                                     "MV2_COMM_WORLD_LOCAL_RANK"], 0),
        local_world_size=get_int_from_env(["LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                           "MV2_COMM_WORLD_LOCAL_SIZE"], 1),
    )


def _nvidia_smi(*query: str) -> list[str]:
    command = shutil.which("nvidia-smi")
    if command is None:
        raise FileNotFoundError("nvidia-smi is not on PATH")
    output = subprocess.check_output([command, *query, "--format=csv,noheader"], text=True)
    return [line.strip() for line in output.strip().splitlines() if line.strip()]


def get_gpu_info() -> tuple[list[str], int]:
    """``(names, count)`` of the NVIDIA GPUs, from ``nvidia-smi`` (CUDA stays uninitialised)."""
    names = [line.split(",")[-1].strip() for line in _nvidia_smi("--query-gpu=count,name")]
    return names, len(names)


def check_cuda_p2p_ib_support() -> bool:
    """False for several RTX 40-series GPUs on drivers older than 550.40.07, whose P2P/InfiniBand
    transfers hang NCCL; True otherwise (including when it cannot be told)."""
    try:
        names, count = get_gpu_info()
        if count > 1 and any("RTX 40" in name for name in names):
            driver = _nvidia_smi("--query-gpu=driver_version")[0]
            return Version(driver) >= Version("550.40.07")
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    return True


def check_cuda_fp8_capability() -> bool:
    """Whether the first GPU has compute capability 8.9 or higher (Ada, Hopper and later)."""
    try:
        capability = tuple(int(part) for part in _nvidia_smi("--query-gpu=compute_capability")[0].split("."))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        import torch

        capability = torch.cuda.get_device_capability()
    return capability >= (8, 9)


def check_os_kernel() -> None:
    """Warn on Linux kernels older than 5.5, on which multi-process training can hang."""
    info = platform.uname()
    if info.system != "Linux":
        return
    match = re.search(r"\d+\.\d+\.\d+", info.release)
    if match and Version(match.group(0)) < Version("5.5.0"):
        _log.warning("kernel %s is older than the recommended 5.5.0; multi-process training can hang on it; "
                     "upgrade the kernel", match.group(0))


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on ``localhost:port`` (default 29500)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", 29500 if port is None else port)) == 0


__all__ = [
    "ENV_PREFIX",
    "CPUInformation",
    "are_libraries_initialized",
    "check_cuda_fp8_capability",
    "check_cuda_p2p_ib_support",
    "check_os_kernel",
    "clear_environment",
    "convert_dict_to_env_variables",
    "get_cpu_distributed_information",
    "get_gpu_info",
    "get_int_from_env",
    "is_port_in_use",
    "parse_choice_from_env",
    "parse_flag_from_env",
    "patch_environment",
    "purge_accelerate_environment",
    "str_to_bool",
]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
