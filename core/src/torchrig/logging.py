"""``get_logger``: a logger that, by default, logs on the main process only.

Level: ``log_level`` argument, else the ``TORCHRIG_LOG_LEVEL`` environment variable, else the
logger's own. Pass ``main_process_only=False`` to log on every rank, ``in_order=True`` to log
rank by rank.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

from torchrig.compat.resolve import module_attributes

LOG_LEVEL_ENV = "TORCHRIG_LOG_LEVEL"


def _rank() -> tuple[int, int]:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover
        pass
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class MultiProcessAdapter(logging.LoggerAdapter):
    """Adds ``main_process_only`` (default True) and ``in_order`` to every logging call."""

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        main_process_only = kwargs.pop("main_process_only", True)
        in_order = kwargs.pop("in_order", False)
        if not self.isEnabledFor(level):
            return
        rank, world = _rank()
        if main_process_only and not in_order:
            if rank == 0:
                msg, kwargs = self.process(msg, kwargs)
                self.logger.log(level, msg, *args, **kwargs)
            return
        if in_order and world > 1:
            import torch.distributed as dist

            for turn in range(world):
                if turn == rank:
                    msg, kwargs = self.process(msg, kwargs)
                    self.logger.log(level, msg, *args, **kwargs)
                dist.barrier()
            return
        msg, kwargs = self.process(msg, kwargs)
        self.logger.log(level, msg, *args, **kwargs)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        rank, world = _rank()
        return (f"[rank {rank}] {msg}" if world > 1 else msg), kwargs


def get_pretty_name(obj: Any) -> str:
    """A readable name for ``obj``: its (or its class's) qualified name, else ``str(obj)``."""
    if not hasattr(obj, "__qualname__") and not hasattr(obj, "__name__"):
        obj = getattr(obj, "__class__", obj)
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or obj)


def get_logger(name: str, log_level: str | None = None) -> MultiProcessAdapter:
    logger = logging.getLogger(name)
    level = log_level or os.environ.get(LOG_LEVEL_ENV)
    if level:
        logger.setLevel(level.upper())
        logger.root.setLevel(level.upper())
    return MultiProcessAdapter(logger, {})


__all__ = ["LOG_LEVEL_ENV", "MultiProcessAdapter", "get_logger", "get_pretty_name"]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
