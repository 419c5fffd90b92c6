"""The context managers of the training step: ``accumulate()`` and ``autocast()``.

Both run on every micro-step, so they are kept allocation-free where nothing needs entering
(``accumulate``), and neither knows which strategy or precision is active: they call the step
plan's callables (``no_sync``, ``autocast``) that the plugins filled.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


class AccumulateContext:
    """The ``accumulate()`` context, reused every micro-step (no generator, no allocation on the
    path where nothing needs suppressing)."""

    __slots__ = ("accelerator", "stack")

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.stack: contextlib.ExitStack | None = None

    def enter(self, models: tuple[Any, ...]) -> AccumulateContext:
        state = self.accelerator.gradient_state
        if state.sync_with_dataloader and state.end_of_dataloader:
            state.step = 0
            state.sync_gradients = True
        else:
            state.step += 1
            state.sync_gradients = state.step % state.num_steps == 0
            if state.sync_gradients:
                state.step = 0
        if not state.sync_gradients and not state.sync_each_batch and models:
            no_sync = self.accelerator.no_sync
            self.stack = contextlib.ExitStack()
            for model in models:
                self.stack.enter_context(no_sync(model))
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        if self.stack is not None:
            stack, self.stack = self.stack, None
            stack.close()


@contextlib.contextmanager
def adjusted_autocast(plan_autocast: Callable[[], Any], device_type: str, handler: Any) -> Iterator[None]:
    """The precision plugin's autocast with ``AutocastKwargs`` applied on top, without the core
    knowing which precision (or dtype) the plugin uses: a nested autocast inherits it."""
    if handler.enabled is False:
        with torch.autocast(device_type=device_type, enabled=False):
            yield
        return
    with plan_autocast():
        if handler.cache_enabled is None or not torch.is_autocast_enabled(device_type):
            yield
            return
        with torch.autocast(device_type=device_type, dtype=torch.get_autocast_dtype(device_type),
                            cache_enabled=handler.cache_enabled):
            yield


__all__ = ["AccumulateContext", "adjusted_autocast"]
