"""Helpers around trackers with Accelerate's names: which tracker plugins are usable here, and a
decorator that confines a tracker method to the main process."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torchrig.distributed.process import PartialState
from torchrig.host.plugin_host import PluginHost, PluginStatus
from torchrig.plugin.kinds import PluginKind


def get_available_trackers() -> list[str]:
    """Names of the installed tracker plugins whose libraries are present (``log_with`` values)."""
    return [info.name for info in PluginHost(register_defaults=False).plugins(PluginKind.TRACKER)
            if info.status in (PluginStatus.AVAILABLE, PluginStatus.SELECTED)]


def on_main_process(function: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for a tracker's methods: when the tracker's ``main_process_only`` is true the
    method runs on the main process only (torchrig's tracker hub already runs trackers there; this
    is for trackers used on their own)."""

    @functools.wraps(function)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self, "main_process_only", False) and not PartialState().is_main_process:
            return None
        return function(self, *args, **kwargs)

    return wrapper


__all__ = ["get_available_trackers", "on_main_process"]
