"""Create models without allocating their weights (Accelerate's ``init_empty_weights`` / ``init_on_device``).

Parameters registered inside the context are moved to the given device (``meta``: shapes and dtypes only,
no memory) as they are registered, keeping their class and attributes. Buffers follow only with
``include_buffers=True`` (then every tensor created in the block lands on the device, through torch's
device context), because buffers are usually small and computed at construction (rotary tables, masks).
``nn.Module.register_parameter`` is restored when the block exits, exception or not.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

#: Accelerate's environment variable for the default of ``include_buffers`` (kept under its own name:
#: ``TORCHRIG_*`` variables are configuration keys).
INCLUDE_BUFFERS_ENV = "ACCELERATE_INIT_INCLUDE_BUFFERS"


def _include_buffers_default() -> bool:
    value = os.environ.get(INCLUDE_BUFFERS_ENV, "false").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"{INCLUDE_BUFFERS_ENV}={value!r}: expected true or false")


@contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> Iterator[None]:
    """Parameters (and with ``include_buffers`` every tensor) created in the block live on ``device``."""
    device = torch.device(device)
    if include_buffers is None:
        include_buffers = _include_buffers_default()
    if include_buffers:
        with device:
            yield
        return
    original_register_parameter = nn.Module.register_parameter

    def register_parameter_on_device(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original_register_parameter(module, name, param)
        if param is None:
            return
        registered = module._parameters[name]
        attributes = dict(registered.__dict__)
        attributes["requires_grad"] = param.requires_grad
        hf_initialized = attributes.pop("_is_hf_initialized", None)  # not a constructor argument
        moved: Any = type(registered)(registered.to(device), **attributes)
        if hf_initialized is not None:
            moved._is_hf_initialized = hf_initialized
        module._parameters[name] = moved

    nn.Module.register_parameter = register_parameter_on_device  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original_register_parameter  # type: ignore[method-assign]


@contextmanager
def init_empty_weights(include_buffers: bool | None = None) -> Iterator[None]:
    """Build a model on the ``meta`` device: no memory for its weights (load or materialise them later)."""
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


__all__ = ["INCLUDE_BUFFERS_ENV", "init_empty_weights", "init_on_device"]
