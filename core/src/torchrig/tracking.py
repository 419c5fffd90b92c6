"""The tracker interface that tracker plugins implement.

Tracker plugins answer ``torchrig_create_trackers`` with :class:`Tracker` objects. The core
calls them on the main process only, from a background queue, so one tracker failing or
blocking never stops or slows training.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Tracker:
    """Base class of experiment trackers (Accelerate's ``GeneralTracker`` names).

    ``name`` is the plugin's name; ``tracker`` is the underlying library object (W&B run,
    SummaryWriter...) returned by ``get_tracker(name, unwrap=True)``.
    """

    name: str = "tracker"
    #: Whether calls must happen on the main process only (the core's default policy).
    main_process_only: bool = True

    @property
    def tracker(self) -> Any:
        return self

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Record hyperparameters (the resolved config, with sources) once per run."""
        raise NotImplementedError(f"tracker {self.name!r} does not record hyperparameters")

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Record scalar (or tracker-specific) values at ``step``."""
        raise NotImplementedError(f"tracker {self.name!r} does not implement log()")

    def finish(self) -> None:
        """Flush and close. Called once by ``end_training``."""


__all__ = ["Tracker"]
