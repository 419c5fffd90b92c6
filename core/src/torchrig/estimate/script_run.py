"""A user's training script run up to its ``accelerator.prepare``, for ``torchrig plan train.py``
and ``torchrig launch --plan-only``: what the script builds (its Accelerator's arguments, its model,
its optimizer) is what gets planned, not a model the plan built.

The script runs as ``python train.py ARGS`` would run it (``__main__``, ``sys.argv``, its folder on
``sys.path``) inside the planned rank's fake world, with the parameters of every module it builds
on the meta device (:func:`torchrig.training.meta_device.init_empty_weights`: no memory for weights;
buffers stay real, they are small and some are computed at construction). The first ``prepare``
that holds a model stops it there: the training loop after it never runs.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import attrs
import torch

from torchrig.accelerator import Accelerator
from torchrig.accelerator.observers import PrepareObserver, observing_prepare
from torchrig.training.meta_device import init_empty_weights


@attrs.frozen
class ScriptTarget:
    """``path`` run with ``args`` (``module``: ``path`` is a module name, as ``python -m``)."""

    path: str
    args: tuple[str, ...] = ()
    module: bool = False

    @property
    def name(self) -> str:
        return self.path if self.module else os.path.basename(self.path)


@attrs.frozen
class PreparedByScript:
    """What the script's first ``prepare`` with a model returned: its Accelerator, the prepared model,
    and the optimizer prepared with it (``None`` when the script prepares its optimizer later)."""

    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: Any


class ScriptError(Exception):
    """The script failed (or ended) before its ``prepare`` returned; ``where`` names the script's line."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(message)
        self.where = where


class _Prepared(BaseException):
    """Raised from the prepare observer to leave the script right after its ``prepare``: a
    ``BaseException``, so a script's ``except Exception`` around ``prepare`` does not swallow it."""

    def __init__(self, prepared: PreparedByScript) -> None:
        super().__init__("prepared")
        self.prepared = prepared


def _first_model_prepare(accelerator: Any, given: tuple[Any, ...], prepared: tuple[Any, ...]) -> None:
    models = [i for i, item in enumerate(given) if isinstance(item, torch.nn.Module)]
    if not models:
        return  # a data loader or scheduler prepared first: the script goes on to its model
    optimizers = [prepared[i] for i, item in enumerate(given) if isinstance(item, torch.optim.Optimizer)]
    raise _Prepared(PreparedByScript(accelerator, prepared[models[0]], optimizers[0] if optimizers else None))


@contextmanager
def _as_main(target: ScriptTarget) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as ``python train.py ARGS`` sets them, restored after."""
    argv, path = sys.argv[:], sys.path[:]
    sys.argv = [target.path, *target.args]
    if not target.module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target.path)))
    elif os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        yield
    finally:
        sys.argv[:], sys.path[:] = argv, path


def _script_line(target: ScriptTarget, exc: BaseException) -> str:
    """``train.py:42``, the deepest frame of the script in ``exc``'s traceback (the script's name alone
    when none is)."""
    wanted = None if target.module else os.path.abspath(target.path)
    line = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if (wanted is not None and os.path.abspath(frame.filename) == wanted) or (
                wanted is None and frame.filename.endswith(target.path.replace(".", os.sep) + ".py")):
            line = frame.lineno
    return f"{target.name}:{line}" if line is not None else target.name


def run_until_prepared(target: ScriptTarget) -> PreparedByScript:
    """Run the script until its first ``prepare`` of a model returns; :class:`ScriptError` when it
    fails before (naming its line) or ends without one. Parameters are created on the meta device
    until the first ``prepare`` starts (the strategy then registers its own: DTensor shards)."""
    if not target.module and not os.path.isfile(target.path):
        raise ScriptError(target.name, f"the script {target.path!r} does not exist")
    construction = ExitStack()
    watch = PrepareObserver(started=lambda accelerator, given: construction.close(), returned=_first_model_prepare)
    try:
        with _as_main(target), observing_prepare(watch), construction:
            construction.enter_context(init_empty_weights(include_buffers=False))
            if target.module:
                runpy.run_module(target.path, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target.path, run_name="__main__")
    except _Prepared as stop:
        return stop.prepared
    except SystemExit as exc:
        raise ScriptError(_script_line(target, exc), f"the script exited (code {exc.code}) before "
                                                     "accelerator.prepare(model, ...) returned") from None
    except Exception as exc:
        text = str(exc).strip() or repr(exc)
        raise ScriptError(_script_line(target, exc), f"{type(exc).__name__}: {text}") from exc
    raise ScriptError(target.name, "the script ended without calling accelerator.prepare on a model: the plan "
                                   "plans what the script prepares (a torch.nn.Module, with its optimizer)")


__all__ = ["PreparedByScript", "ScriptError", "ScriptTarget", "run_until_prepared"]
