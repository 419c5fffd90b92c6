"""The experiment-tracker interface: :class:`Tracker` (Accelerate's ``GeneralTracker``) and the
value helpers tracker authors use.

Its own small module so that what only needs the type — the configuration layer
(``log_with`` accepts instances), the hook specs, a tracker's lane — does not import the tracking
policy (:mod:`torchrig.tracking`) and what that policy depends on. Torch-free.
"""

from __future__ import annotations

import enum
import logging
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

logger = logging.getLogger("torchrig.tracking")


class LogEvent(NamedTuple):
    """One queued ``log`` call, as :meth:`Tracker.log_many` receives it."""

    values: Mapping[str, Any]
    step: int | None


#: What a lane installs on its tracker to count values the tracker could not record:
#: ``(name, type name, why, truncated)``.
ValueLossSink = Callable[[str, str, str, bool], None]


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
    #: Room for a fast loop logging every step while the tracker connects (a few MB of scalars).
    queue_size: int = 10_000
    #: Seconds without progress after which the core gives up on this tracker: ``end_training``
    #: waits while calls keep returning and abandons the tracker only when none has returned for
    #: this long (stuck, not slow); ``get_tracker(name, unwrap=True)`` waits this long for ``start``.
    wait_timeout: float = 30.0
    #: At most this many queued ``log`` events go to one :meth:`log_many` call.
    max_batch_events: int = 1000
    #: Set by the core's lane: where :meth:`value_not_recorded` reports (None: a plain warning).
    _value_loss_sink: ValueLossSink | None = None

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

    def log_many(self, events: Sequence[LogEvent], **kwargs: Any) -> None:
        """Record several queued ``log`` events (in order) in as few library calls as it allows.

        Optional: a tracker that overrides it gets every ``log`` event waiting in its queue (up
        to :attr:`max_batch_events`, consecutive, with the same ``kwargs``) in one call, so a slow
        server costs one round trip per batch, not per event. Raising fails the whole batch.
        """
        for event in events:
            self.log(event.values, event.step, **kwargs)

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
        """Whether this tracker implements an optional method (``"log_images"``, ``"log_table"``,
        ``"log_many"``)."""
        return getattr(type(self), method, None) is not getattr(Tracker, method, None)

    def value_not_recorded(self, name: str, value: Any, why: str, *, truncated: bool = False) -> None:
        """Say that the value ``name`` was skipped (or, with ``truncated``, cut short) because the
        library cannot take it: a tracker never drops a value silently. The core counts it in
        this tracker's report (``skipped_values`` / ``truncated_values``) and warns once per name."""
        sink = self._value_loss_sink
        if sink is not None:
            sink(name, type(value).__name__, why, truncated)
            return
        said = self.__dict__.setdefault("_values_said", set())
        if name not in said:
            said.add(name)
            logger.warning("tracker %r: value %r (%s) is %s: %s", self.name, name, type(value).__name__,
                           "truncated" if truncated else "not recorded", why)


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


__all__ = ["LogEvent", "Tracker", "ValueLossSink", "as_scalar", "flatten", "jsonable"]
