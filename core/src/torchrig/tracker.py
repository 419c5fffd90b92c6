"""The experiment-tracker interface: :class:`Tracker` (Accelerate's ``GeneralTracker``) and the
value helpers tracker authors use.

Its own small module so that what only needs the type — the configuration layer
(``log_with`` accepts instances), the hook specs, a tracker's lane — does not import the tracking
policy (:mod:`torchrig.tracking`) and what that policy depends on. Torch-free.
"""

from __future__ import annotations

import enum
import numbers
from collections.abc import Mapping
from typing import Any


class Tracker:
    """Base class of experiment trackers, with Hugging Face Accelerate's ``GeneralTracker`` names.

    Subclass it for a custom tracker (pass the instance in ``log_with``) or return instances from
    a tracker plugin's ``torchrig_create_trackers``. The core calls every method from the
    tracker's own worker thread, one call at a time, in order:
    ``start()`` → ``store_init_configuration()`` → ``log()``/``log_images()``/``log_table()``... →
    ``finish()``. A method that raises loses that one event (counted and reported); a method
    that blocks makes the tracker fall behind and lose the events that no longer fit in its
    queue. Neither stops the training loop.

    Keep ``__init__`` cheap and free of I/O (it runs in ``init_trackers`` on the training
    thread); connect, create the run and open files in :meth:`start`.

    Values reach :meth:`log` as the user passed them, snapshotted at the call (tensors are
    detached copies): use :func:`as_scalar` and :func:`flatten` to turn them into what the
    library accepts. Do not modify them: every tracker receives the same objects.
    """

    #: The name in ``log_with``, ``init_kwargs``, ``log_kwargs`` and ``get_tracker``.
    name: str = "tracker"
    #: Whether the tracker writes under ``logging_dir`` (informational, as in Accelerate).
    requires_logging_directory: bool = False
    #: Run on the main process only (the default policy). ``False``: on every rank.
    main_process_only: bool = True
    #: The library refuses a step lower than the last one logged (W&B): the core drops such
    #: events for this tracker, counted as ``rejected_steps``, instead of sending them.
    monotonic_steps: bool = False
    #: Events that may wait for this tracker; beyond, new events are dropped (``queue_full``).
    queue_size: int = 1000
    #: Seconds the core waits for this tracker when it must: ``end_training`` (drain the queue
    #: and ``finish``) and ``get_tracker(name, unwrap=True)`` before ``start`` completed.
    wait_timeout: float = 30.0

    @property
    def tracker(self) -> Any:
        """The library's own object (W&B run, ``SummaryWriter``, MLflow run), for
        ``get_tracker(name, unwrap=True)``. Default: the tracker itself."""
        return self

    def start(self) -> None:
        """Connect and create the run (called once, first, on the worker thread). Default: nothing to start."""

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        """Record the run's hyperparameters, once: the user's ``config`` plus ``torchrig``
        (resolved configuration) and ``torchrig_sources`` (where non-default values came from).
        Default: not recorded."""

    def log(self, values: Mapping[str, Any], step: int | None, **kwargs: Any) -> None:
        """Record ``values`` (name -> number, string, tensor...) at ``step``. Must be implemented.

        ``kwargs`` are this tracker's entry of ``log_kwargs``.
        """
        raise NotImplementedError(f"tracker {self.name!r} ({type(self).__qualname__}) does not implement log()")

    def log_images(self, values: Mapping[str, Any], step: int | None, **kwargs: Any) -> None:
        """Record images (name -> image or list/batch of images) at ``step``. Optional: a tracker
        that does not override it is skipped by ``log_images`` calls."""
        raise NotImplementedError(f"tracker {self.name!r} does not support log_images()")

    def log_table(self, table_name: str, columns: list[str] | None = None, data: list[list[Any]] | None = None,
                  dataframe: Any = None, step: int | None = None, **kwargs: Any) -> None:
        """Record a table (``columns`` + rows in ``data``, or a pandas ``dataframe``). Optional,
        like :meth:`log_images`."""
        raise NotImplementedError(f"tracker {self.name!r} does not support log_table()")

    def finish(self) -> None:
        """Flush and close (called once, last, by ``end_training`` or at interpreter exit).
        Default: nothing to close."""

    def supports(self, method: str) -> bool:
        """Whether this tracker implements an optional method (``"log_images"``, ``"log_table"``)."""
        return getattr(type(self), method, None) is not getattr(Tracker, method, None)


# --------------------------------------------------------------------------------------------
# helpers for tracker authors


def as_scalar(value: Any) -> int | float | bool | None:
    """A Python number for numbers, numpy scalars and one-element tensors/arrays; else None."""
    if isinstance(value, (bool, int, float)):
        return value
    item = getattr(value, "item", None)
    if callable(item):
        numel = getattr(value, "numel", None)
        count = numel() if callable(numel) else getattr(value, "size", None)
        if count == 1:
            result = item()
            return result if isinstance(result, (bool, int, float)) else None
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    return None


def flatten(values: Mapping[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """Nested mappings joined into one level: ``{"a": {"b": 1}}`` -> ``{"a/b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, sep, name))
        else:
            out[name] = value
    return out


def jsonable(value: Any) -> Any:
    """``value`` as JSON types: scalars as numbers, tensors/arrays as nested lists, enums by
    value, mappings and sequences recursively, anything else as ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return jsonable(value.value)
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    scalar = as_scalar(value)
    if scalar is not None:
        return scalar
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return jsonable(tolist())
    return str(value)


__all__ = ["Tracker", "as_scalar", "flatten", "jsonable"]
