"""The ``tensorboard`` tracker: ``torch.utils.tensorboard.SummaryWriter`` event files.

One writer, in ``<logging_dir>/<project_name>`` (the current directory stands for an unset
``logging_dir``); TensorBoard shows it as one run. Steps are written as given: TensorBoard
accepts any order (a resumed job may rewrite steps; pass ``purge_step`` in
``init_kwargs["tensorboard"]`` to discard the old events from that step on).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from torchrig.plugin import RunContext, Tracker, as_scalar, flatten, hookimpl, jsonable


class TensorBoardTracker(Tracker):
    """``log``: numbers → ``add_scalar``, strings → ``add_text``, tensors/arrays with several
    elements → ``add_histogram``, nested mappings flattened with ``/`` (never ``add_scalars``,
    which would create one more run per key). ``store_init_configuration``: TensorBoard's
    HParams summary in the same run plus a text table. ``log_images``: ``add_images`` (a batch,
    ``dataformats`` as TensorBoard's, default ``NCHW``) or ``add_image`` for a single image
    when ``dataformats`` has three letters."""

    name = "tensorboard"
    requires_logging_directory = True

    #: ``SummaryWriter`` arguments accepted in ``init_kwargs["tensorboard"]`` (``log_dir`` is ours).
    writer_arguments = ("comment", "purge_step", "max_queue", "flush_secs", "filename_suffix")

    def __init__(self, run_name: str, logging_dir: str | None = None, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(self.writer_arguments))
        if unknown:
            raise TypeError(f"unknown SummaryWriter argument(s) {', '.join(unknown)}; accepted: "
                            f"{', '.join(self.writer_arguments)} (the directory is <logging_dir>/<project_name>)")
        self.log_dir = os.path.join(logging_dir if logging_dir else os.getcwd(), run_name)
        self.writer_kwargs = kwargs
        self.writer: Any = None

    @property
    def tracker(self) -> Any:
        return self.writer

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(self.log_dir, **self.writer_kwargs)

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams

        flat = {key: _hparam(value) for key, value in flatten(values).items()}
        for summary in hparams(flat, {}):
            self.writer.file_writer.add_summary(summary)
        rows = "\n".join(f"| {key} | {json.dumps(jsonable(value))} |" for key, value in flatten(values).items())
        self.writer.add_text("hyperparameters", "| name | value |\n|---|---|\n" + rows)
        self.writer.flush()

    def log(self, values: Mapping[str, Any], step: int | None, **kwargs: Any) -> None:
        for key, value in flatten(values).items():
            scalar = as_scalar(value)
            if scalar is not None:
                self.writer.add_scalar(key, scalar, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif hasattr(value, "shape"):
                self.writer.add_histogram(key, value, global_step=step, **kwargs)
            else:
                self.value_not_recorded(key, value, "TensorBoard takes numbers, strings and tensors/arrays")

    def log_images(self, values: Mapping[str, Any], step: int | None, **kwargs: Any) -> None:
        single = len(str(kwargs.get("dataformats", "NCHW"))) == 3
        for key, images in values.items():
            if single:
                self.writer.add_image(key, images, global_step=step, **kwargs)
            else:
                self.writer.add_images(key, images, global_step=step, **kwargs)

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _hparam(value: Any) -> Any:
    """HParams accept numbers, strings and booleans: the rest as JSON text."""
    scalar = as_scalar(value)
    if scalar is not None:
        return scalar
    if isinstance(value, str):
        return value
    return json.dumps(jsonable(value))


class TensorBoardPlugin:
    """Runtime entry point ``tensorboard``: one :class:`TensorBoardTracker`;
    ``init_kwargs["tensorboard"]`` goes to ``SummaryWriter`` (``flush_secs``, ``purge_step``...)."""

    @hookimpl
    def torchrig_create_trackers(self, run: RunContext, project_name: str, logging_dir: str | None,
                                 init_kwargs: Mapping[str, Mapping[str, Any]]) -> list[Tracker]:
        return [TensorBoardTracker(project_name, logging_dir, **init_kwargs.get("tensorboard", {}))]


__all__ = ["TensorBoardPlugin", "TensorBoardTracker"]
