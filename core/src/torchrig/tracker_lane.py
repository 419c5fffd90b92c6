"""One tracker's lane: its bounded queue, its worker thread and the counters of what happened
to every event.

Why a thread per tracker: a tracker that blocks (network down) or raises must never stop or
slow training; its events wait in a bounded queue and are dropped, and counted, when it falls
behind. Every event ends delivered or counted under one of :data:`DROP_REASONS`, also when the
tracker's thread dies (a ``SystemExit`` from a library is a failed call; anything that still
ends the thread marks the lane ``crashed``). The policy around the lanes is
:mod:`torchrig.tracking`'s.

Torch-free.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from torchrig.tracker import Tracker

logger = logging.getLogger("torchrig.tracking")  # one logger for the whole tracking policy

#: Warnings per tracker shown at once before rate limiting starts, and the interval after which
#: one more (with the number suppressed meanwhile) is shown.
WARNING_BURST = 3
WARNING_INTERVAL = 60.0
#: Why an event did not reach its tracker (the report's counters summed into ``dropped``).
#: ``crashed``: events that were queued, in flight or logged after the tracker's thread died.
DROP_REASONS = ("failed", "queue_full", "rejected_steps", "abandoned", "not_started", "crashed")


class _Stop:
    """The last event of a lane: call ``finish`` and end the worker."""


_STOP = _Stop()


class _Warner:
    """Rate-limited warnings of one tracker: the first :data:`WARNING_BURST` at once, then at
    most one per :data:`WARNING_INTERVAL` seconds, saying how many were suppressed meanwhile."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.clock = clock
        self.lock = threading.Lock()
        self.shown = 0
        self.suppressed = 0
        self.last_shown = float("-inf")

    def __call__(self, message: str) -> None:
        with self.lock:
            now = self.clock()
            if self.shown >= WARNING_BURST and now - self.last_shown < WARNING_INTERVAL:
                self.suppressed += 1
                return
            suffix = f" ({self.suppressed} similar warnings suppressed)" if self.suppressed else ""
            self.shown, self.suppressed, self.last_shown = self.shown + 1, 0, now
        logger.warning("tracker %r: %s%s", self.name, message, suffix)


class _Lane:
    """One tracker with its bounded queue and worker thread."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker
        self.name = str(tracker.name)
        self.capacity = max(1, int(tracker.queue_size))
        self.warn = _Warner(self.name)
        self.cond = threading.Condition()
        self.events: collections.deque[Any] = collections.deque()
        self.started = threading.Event()  # start() returned or raised
        self.start_error: str | None = None
        self.closed = False  # no more events accepted
        self.abandoned = False  # end_training stopped waiting; the worker must not go on
        self.busy_since: float | None = None
        self.busy_with: str | None = None
        self.last_step: int | None = None  # last step accepted (monotonic trackers)
        #: delivered: calls that returned; failed: events whose call raised; errors: every exception
        #: (start and finish too); the other keys count events that never reached the tracker.
        self.counts = {"delivered": 0, "failed": 0, "errors": 0, "queue_full": 0, "rejected_steps": 0,
                       "abandoned": 0, "not_started": 0, "crashed": 0, "unsupported": 0}
        self.last_error: str | None = None
        self.state = "running"
        self.thread = threading.Thread(target=self._work, name=f"torchrig-tracker-{self.name}", daemon=True)
        self.thread.start()

    # -- training thread side ---------------------------------------------------------------

    def submit(self, method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any], step: int | None = None) -> bool:
        """Queue one call; never blocks. Returns whether it was queued."""
        if method in ("log_images", "log_table") and not self.tracker.supports(method):
            with self.cond:
                self.counts["unsupported"] += 1
                first = self.counts["unsupported"] == 1
            if first:
                self.warn(f"does not support {method}(); such calls are skipped for this tracker")
            return False
        with self.cond:
            if self.state == "crashed":  # its thread is gone: nothing would ever take the event
                self.counts["crashed"] += 1
                return False
            if self.closed:
                return False
            if step is not None and self.tracker.monotonic_steps:
                if self.last_step is not None and step < self.last_step:
                    self.counts["rejected_steps"] += 1
                    rejected = self.last_step
                else:
                    self.last_step, rejected = step, None
            else:
                rejected = None
            if rejected is None and len(self.events) >= self.capacity:
                self.counts["queue_full"] += 1
                full = True
            else:
                full = False
                if rejected is None:
                    self.events.append((method, args, dict(kwargs)))
                    self.cond.notify()
            busy = self._busy_text()
        if rejected is not None:
            self.warn(f"step {step} is lower than the last step logged ({rejected}) and this tracker needs "
                      f"increasing steps; the event was dropped (log with increasing steps)")
            return False
        if full:
            self.warn(f"falling behind ({self.capacity} events waiting{busy}); new events are dropped until it catches up")
            return False
        return True

    def close(self) -> None:
        with self.cond:
            if not self.closed:
                self.closed = True
                self.events.append(_STOP)
                self.cond.notify()

    def join(self, deadline: float) -> None:
        """Wait until the worker finished or ``deadline`` (monotonic) passed; then abandon it."""
        self.thread.join(max(0.0, deadline - time.monotonic()))
        if not self.thread.is_alive():
            return
        with self.cond:
            self.abandoned = True
            left = [e for e in self.events if e is not _STOP]
            in_flight = self.busy_with not in (None, "start", "finish")  # its outcome will not be counted
            self.counts["abandoned"] += len(left) + in_flight
            self.events.clear()
            busy = self._busy_text()
            self.state = "abandoned"
            self.cond.notify()
        logger.warning("tracker %r: did not finish within %.1f s%s; %d queued events dropped, its thread is left "
                       "behind", self.name, self.tracker.wait_timeout, busy, len(left))

    def unwrap(self) -> Any:
        """The library object, once ``start`` completed (waiting up to ``wait_timeout``); None if
        it never will be (the caller hands out a stand-in)."""
        if not self.started.wait(self.tracker.wait_timeout):
            logger.warning("tracker %r: not started within %.1f s; get_tracker(unwrap=True) returns a stand-in that "
                           "ignores every call", self.name, self.tracker.wait_timeout)
            return None
        if self.start_error is not None:
            logger.warning("tracker %r: failed to start (%s); get_tracker(unwrap=True) returns a stand-in that "
                           "ignores every call", self.name, self.start_error)
            return None
        return self.tracker.tracker

    def report(self) -> dict[str, Any]:
        with self.cond:
            counts = dict(self.counts)
            state, last_error = self.state, self.last_error
        dropped = sum(counts[k] for k in DROP_REASONS)
        return {"state": state, "delivered": counts["delivered"], "dropped": dropped, **counts, "last_error": last_error}

    def _busy_text(self) -> str:
        """Where the worker is stuck, when one call has taken over a second (network down)."""
        if self.busy_since is None or time.monotonic() - self.busy_since < 1.0:
            return ""
        return f"; blocked in {self.busy_with}() for {time.monotonic() - self.busy_since:.1f} s"

    # -- worker thread side ------------------------------------------------------------------

    def _work(self) -> None:
        """The thread's body; whatever ends it early (even ``SystemExit`` raised by a logging
        handler) is reported, and the events it leaves are counted as dropped."""
        try:
            self._serve()
        except BaseException as exc:
            self._died(exc)

    def _died(self, exc: BaseException) -> None:
        text = f"its thread died: {_describe(exc)}"
        with self.cond:
            if self.abandoned:
                return
            in_flight = self.busy_with not in (None, "start", "finish")
            left = [e for e in self.events if e is not _STOP]
            self.events.clear()
            self.counts["crashed"] += len(left) + in_flight
            self.counts["errors"] += 1
            self.last_error, self.state, self.closed = text, "crashed", True
            if not self.started.is_set():
                self.start_error = text
        self.started.set()
        logger.error("tracker %r: %s; %d queued event(s) dropped, later events are dropped too", self.name, text,
                     len(left) + in_flight)

    def _serve(self) -> None:
        self._call("start", (), {})
        with self.cond:
            if self.counts["errors"]:
                self.start_error = self.last_error
        self.started.set()
        while True:
            with self.cond:
                while not self.events and not self.abandoned:
                    self.cond.wait()
                if self.abandoned:
                    return
                event = self.events.popleft()
            if event is _STOP:
                if self.start_error is None:
                    self._call("finish", (), {})
                with self.cond:
                    if self.state == "running":
                        self.state = "failed" if self.start_error is not None else "finished"
                return
            method, args, kwargs = event
            if self.start_error is not None:
                with self.cond:
                    self.counts["not_started"] += 1
                continue
            if self._call(method, args, kwargs):
                with self.cond:
                    if self.abandoned:  # counted as abandoned while it was in flight
                        return
                    self.counts["delivered"] += 1

    def _call(self, method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bool:
        with self.cond:
            if self.abandoned:
                return False
            self.busy_since, self.busy_with = time.monotonic(), method
        try:
            getattr(self.tracker, method)(*args, **kwargs)
            return True
        except BaseException as exc:
            text = _describe(exc)
            with self.cond:
                if self.abandoned:
                    return False
                self.counts["errors"] += 1
                if method not in ("start", "finish"):
                    self.counts["failed"] += 1
                self.last_error = text
            what = "failed to start; its events will be dropped" if method == "start" else f"{method}() raised"
            self.warn(f"{what}: {text}")
            return False
        finally:
            with self.cond:
                self.busy_since = self.busy_with = None


def _describe(exc: BaseException) -> str:
    """``Type: message``, also for an exception whose ``__str__`` itself fails."""
    try:
        message = str(exc)
    except BaseException:
        message = "<unprintable>"
    return f"{type(exc).__name__}: {message}"


__all__ = ["DROP_REASONS", "WARNING_BURST", "WARNING_INTERVAL"]
