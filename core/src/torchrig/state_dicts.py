"""Plain state-dict checkpoint state: the core's default for strategies that replicate the model.

The main process writes one file per model and per optimizer; every rank loads them. The
commit protocol around these files (temporary directory, fsync, manifest, rename) is the
checkpoint layer's job, not this module's.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.run import RunContext
    from torchrig.types import PreparedModel


def _names(index: int, prepared: PreparedModel) -> tuple[str, list[str]]:
    return f"model_{index}.pt", [f"optimizer_{index}_{j}.pt" for j in range(len(prepared.optimizers))]


def save_plain_state(run: RunContext, prepared: Sequence[PreparedModel], directory: str) -> list[str]:
    """Write model and optimizer state dicts on the main process; returns the files written."""
    if not run.cluster.is_main_process:
        return []
    written = []
    for index, item in enumerate(prepared):
        model_file, optimizer_files = _names(index, item)
        torch.save(item.unwrapped.state_dict(), os.path.join(directory, model_file))
        written.append(model_file)
        for optimizer, name in zip(item.optimizers, optimizer_files):
            torch.save(optimizer.state_dict(), os.path.join(directory, name))
            written.append(name)
    return written


def load_plain_state(run: RunContext, prepared: Sequence[PreparedModel], directory: str) -> None:
    """Load what :func:`save_plain_state` wrote, onto this rank's device."""
    assert run.device is not None
    location = run.device.device
    for index, item in enumerate(prepared):
        model_file, optimizer_files = _names(index, item)
        state = torch.load(os.path.join(directory, model_file), map_location=location, weights_only=True)
        item.unwrapped.load_state_dict(state)
        for optimizer, name in zip(item.optimizers, optimizer_files):
            optimizer.load_state_dict(torch.load(os.path.join(directory, name), map_location=location, weights_only=True))


__all__ = ["load_plain_state", "save_plain_state"]
