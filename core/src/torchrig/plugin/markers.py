"""The pluggy markers of torchrig's hook contract.

``hookimpl`` is what plugin authors decorate their hook implementations with; ``hookspec``
is used only by :mod:`torchrig.plugin.hookspecs`. Both belong to the pluggy project ``"torchrig"``.
"""

from __future__ import annotations

import pluggy

PROJECT_NAME = "torchrig"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

__all__ = ["PROJECT_NAME", "hookimpl", "hookspec"]
