"""How the fsdp plugin speaks about its configuration: :class:`FSDPConfigError` for a value that
cannot be applied (the message names the key and the fix), and :data:`noted`, which logs each
explanation of a no-op option or a fallback once per process rather than once per prepare."""

from __future__ import annotations

from torchrig.plugin import get_logger

logger = get_logger(__name__)


class FSDPConfigError(ValueError):
    """An ``fsdp_config`` value that cannot be applied to this model or this job. The message
    names the key and how to fix it."""


class _Once:
    """Log each explanation once per process (no-op options, fallbacks), not once per prepare."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def info(self, key: str, message: str) -> None:
        if key not in self.seen:
            self.seen.add(key)
            logger.info(message)


noted = _Once()


__all__ = ["FSDPConfigError", "noted"]
