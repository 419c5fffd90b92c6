"""Checkpoints through Ray Train: torchrig commits them, Ray records them.

``report(accelerator, metrics, checkpoint=True)`` saves with ``accelerator.save_state`` (the
commit protocol: every rank writes, rank 0 commits and renames; the call returns on every rank
once the checkpoint is committed), then calls ``ray.train.report`` on every rank (Ray requires
all workers to report, the same number of times): rank 0 with
``ray.train.Checkpoint.from_directory(<committed directory>)``, the others with none, since the
committed directory already holds every rank's files. Ray copies it into the run's
``storage_path`` and lists it in ``Result.checkpoint`` / ``best_checkpoints``.

``load_checkpoint(accelerator)`` resumes from the checkpoint Ray hands a restarted run
(``ray.train.get_checkpoint()``, rank 0's broadcast to every rank): ``accelerator.load_state`` on
its directory, which verifies the manifest as for any torchrig checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ray.train
import torch.distributed


def report(accelerator: Any, metrics: Mapping[str, Any], *, checkpoint: bool = False,
           output_dir: str | os.PathLike | None = None, **report_kwargs: Any) -> str | None:
    """Report ``metrics`` to Ray Train from every rank; with ``checkpoint=True`` first save a
    committed torchrig checkpoint (``output_dir`` as for ``save_state``) and report it.

    Returns the committed checkpoint directory (``None`` without ``checkpoint``). Extra keyword
    arguments go to ``ray.train.report`` (``checkpoint_dir_name``...). Call it on every rank.
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"report: metrics must be a mapping of names to values, not {type(metrics).__name__}")
    directory = None
    ray_checkpoint = None
    if checkpoint:
        directory = accelerator.save_state(output_dir, async_save=False)
        if accelerator.is_main_process:
            ray_checkpoint = ray.train.Checkpoint.from_directory(directory)
    ray.train.report(dict(metrics), checkpoint=ray_checkpoint, **report_kwargs)
    return directory


def load_checkpoint(accelerator: Any, **load_kwargs: Any) -> str | None:
    """Load the checkpoint Ray Train offers this run (``ray.train.get_checkpoint()``) into the
    prepared objects; ``None`` when Ray has none (a fresh run). Call it on every rank.

    Rank 0's answer is broadcast, so every rank loads the same checkpoint or none (Ray hands a
    restarted run's checkpoint to every worker, but within a run only the ranks that reported it
    know it). Keyword arguments go to ``accelerator.load_state``, which verifies the manifest.
    """
    offered = [ray.train.get_checkpoint()]
    if accelerator.num_processes > 1:
        torch.distributed.broadcast_object_list(offered, src=0)
    if offered[0] is None:
        return None
    with offered[0].as_directory() as directory:
        accelerator.load_state(directory, **load_kwargs)
        return str(directory)


__all__ = ["load_checkpoint", "report"]
