"""Who may watch ``Accelerator.prepare``: ``torchrig plan`` runs a user's script up to its
``prepare`` (:mod:`torchrig.estimate.script_run`), ends the script's meta-device construction when
``prepare`` starts and takes the prepared objects when it returns.

Callbacks rather than a hook of the plugin contract: what watches is a tool around the run (the
plan), not a plugin of it, and it must see the user's own Accelerator, whatever plugins that one
loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import attrs


@attrs.frozen
class PrepareObserver:
    """``started(accelerator, given)`` as a ``prepare`` call starts; ``returned(accelerator, given,
    prepared)`` as it returns (``prepared``: what it returns for each of ``given``). Either may raise to
    stop the caller there (the plan stops a script so)."""

    started: Callable[[Any, tuple[Any, ...]], None] | None = None
    returned: Callable[[Any, tuple[Any, ...], tuple[Any, ...]], None] | None = None


_OBSERVERS: list[PrepareObserver] = []


@contextlib.contextmanager
def observing_prepare(observer: PrepareObserver) -> Iterator[None]:
    """``observer`` watches every ``prepare`` called inside the block."""
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


def prepare_started(accelerator: Any, given: tuple[Any, ...]) -> None:
    """Tell the observers (none outside a plan: one empty-list check per ``prepare``)."""
    for observer in list(_OBSERVERS):
        if observer.started is not None:
            observer.started(accelerator, given)


def prepare_returned(accelerator: Any, given: tuple[Any, ...], prepared: tuple[Any, ...]) -> None:
    for observer in list(_OBSERVERS):
        if observer.returned is not None:
            observer.returned(accelerator, given, prepared)


__all__ = ["PrepareObserver", "observing_prepare", "prepare_returned", "prepare_started"]
