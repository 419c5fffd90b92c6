"""The ``wandb`` tracker: one Weights & Biases run per job.

``wandb.init`` runs once, on the main process (the core's policy), on the tracker's worker
thread — a W&B server that does not answer delays only this tracker, never training. With
``WANDB_MODE=offline`` the run is written to ``<logging_dir>/wandb/offline-run-*`` (sync it
later with ``wandb sync``).

Steps: W&B refuses a step lower than the last one logged (it ignores the data with a warning),
so this tracker declares ``monotonic_steps``: the core drops such events for W&B, counts them
(``rejected_steps``) and warns, while the other trackers still record them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from torchrig.plugin import RunContext, Tracker, as_scalar, hookimpl


class WandBTracker(Tracker):
    """``start``: ``wandb.init(project=<project_name>, dir=<logging_dir>, **init_kwargs["wandb"])``
    (a new run, even if another W&B run is active in this process); ``store_init_configuration``:
    ``run.config.update`` (nested); ``log``: ``run.log(values, step=step)``; ``log_images``:
    ``wandb.Image`` per image; ``log_table``: ``wandb.Table``; ``finish``: ``run.finish()``.
    ``get_tracker("wandb", unwrap=True)`` is the ``wandb`` run."""

    name = "wandb"
    requires_logging_directory = False
    monotonic_steps = True
    #: ``finish`` uploads what is left: allow it more time than the default.
    wait_timeout = 120.0

    def __init__(self, run_name: str, logging_dir: str | None = None, **kwargs: Any) -> None:
        self.run_name = run_name
        self.logging_dir = logging_dir
        self.init_kwargs = dict(kwargs)
        self.run: Any = None

    @property
    def tracker(self) -> Any:
        return self.run

    def start(self) -> None:
        import wandb

        kwargs = dict(self.init_kwargs)
        kwargs.setdefault("project", self.run_name)
        if self.logging_dir:
            os.makedirs(self.logging_dir, exist_ok=True)
            # absolute: wandb's service process resolves a relative dir against its own working
            # directory, which is another process's when the service was started elsewhere
            kwargs.setdefault("dir", os.path.abspath(self.logging_dir))
        if _version(wandb.__version__) >= (0, 19, 10):
            kwargs.setdefault("reinit", "create_new")  # our own run, not another Accelerator's
        self.run = wandb.init(**kwargs)

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self.run.config.update(dict(values), allow_val_change=True)

    def log(self, values: Mapping[str, Any], step: int | None, **kwargs: Any) -> None:
        self.run.log(_plain(values), step=step, **kwargs)

    def log_images(self, values: Mapping[str, Any], step: int | None, **kwargs: Any) -> None:
        import wandb

        images = {key: [wandb.Image(image) for image in (value if isinstance(value, (list, tuple)) else [value])]
                  for key, value in values.items()}
        self.run.log(images, step=step, **kwargs)

    def log_table(self, table_name: str, columns: list[str] | None = None, data: list[list[Any]] | None = None,
                  dataframe: Any = None, step: int | None = None, **kwargs: Any) -> None:
        import wandb

        self.run.log({table_name: wandb.Table(columns=columns, data=data, dataframe=dataframe)}, step=step, **kwargs)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """One-element tensors as Python numbers (W&B would log them as histograms)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out[key] = _plain(value)
        else:
            scalar = as_scalar(value)
            out[key] = value if scalar is None else scalar
    return out


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


class WandBPlugin:
    """Runtime entry point ``wandb``: one :class:`WandBTracker`; ``init_kwargs["wandb"]`` goes to
    ``wandb.init`` (``entity``, ``name``, ``tags``, ``mode``, ``id``/``resume``...)."""

    @hookimpl
    def torchrig_create_trackers(self, run: RunContext, project_name: str, logging_dir: str | None,
                                 init_kwargs: Mapping[str, Mapping[str, Any]]) -> list[Tracker]:
        return [WandBTracker(project_name, logging_dir, **init_kwargs.get("wandb", {}))]


__all__ = ["WandBPlugin", "WandBTracker"]
