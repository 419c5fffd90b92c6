"""Who may watch ``Accelerator.prepare`` finish: ``torchrig plan`` runs a user's script up to its
``prepare`` (:mod:`torchrig.estimate.script_run`) and takes the prepared objects from there.

A list of callbacks rather than a hook of the plugin contract: what watches is a tool around the
run (the plan), not a plugin of it, and it must see the user's own Accelerator, whatever plugins
that one loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

#: ``observer(accelerator, given, prepared)``: the arguments of a ``prepare`` call and what it returned for each.
PrepareObserver = Callable[[Any, tuple[Any, ...], tuple[Any, ...]], None]

_PREPARE_OBSERVERS: list[PrepareObserver] = []


@contextlib.contextmanager
def observing_prepare(observer: PrepareObserver) -> Iterator[None]:
    """Call ``observer`` after every ``prepare`` that returns inside the block (it may raise to stop the
    caller there: the plan stops a script so)."""
    _PREPARE_OBSERVERS.append(observer)
    try:
        yield
    finally:
        _PREPARE_OBSERVERS.remove(observer)


def prepare_returned(accelerator: Any, given: tuple[Any, ...], prepared: tuple[Any, ...]) -> None:
    """Tell the observers (none outside a plan: one empty-list check per ``prepare``)."""
    for observer in list(_PREPARE_OBSERVERS):
        observer(accelerator, given, prepared)


__all__ = ["PrepareObserver", "observing_prepare", "prepare_returned"]
