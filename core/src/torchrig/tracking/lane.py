"""One tracker's lane: its bounded queue, its worker thread and the counters of what happened
to every event.

Why a thread per tracker: a tracker that blocks (network down) or raises must never stop or
slow training; its events wait in a bounded queue and are dropped, and counted, when it falls
behind. Every event ends delivered or counted under one of :data:`DROP_REASONS`, with the steps
it covered, also when the tracker's thread dies (a ``SystemExit`` from a library is a failed
call; anything that still ends the thread marks the lane ``crashed``). A slow tracker is not a
stuck one: queued ``log`` events go to a tracker that can batch in one call
(:meth:`Tracker.log_many`), and the end-of-run wait lasts while calls keep returning. The
policy around the lanes is :mod:`torchrig.tracking`'s.

Torch-free.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from torchrig.plugin.tracker import LogEvent, Tracker

logger = logging.getLogger("torchrig.tracking")  # one logger for the whole tracking policy

#: Warnings per tracker shown at once before rate limiting starts, and the interval after which
#: one more (with the number suppressed meanwhile) is shown.
WARNING_BURST = 3
WARNING_INTERVAL = 60.0
#: Why an event did not reach its tracker (the report's counters summed into ``dropped``).
#: ``crashed``: events that were queued, in flight or logged after the tracker's thread died;
#: ``after_end``: events logged after ``end_training`` finished the tracker.
DROP_REASONS = ("failed", "queue_full", "rejected_steps", "abandoned", "not_started", "crashed", "after_end")
#: Step ranges kept per drop reason; beyond, the closest ranges merge (the report stays small).
MAX_STEP_RANGES = 32


class StepRanges:
    """Steps as sorted, disjoint ``[first, last]`` ranges: which steps a kind of drop covered.

    At most :data:`MAX_STEP_RANGES` ranges: past that, the two ranges with the smallest gap
    merge, so the ranges still cover every dropped step (and possibly a few that were not)."""

    def __init__(self) -> None:
        self.ranges: list[list[int]] = []

    def add(self, step: int | None) -> None:
        if step is None:
            return
        ranges = self.ranges
        if ranges and ranges[-1][0] <= step <= ranges[-1][1] + 1:  # the usual case: increasing steps
            ranges[-1][1] = max(ranges[-1][1], step)
            return
        at = bisect.bisect_right([r[0] for r in ranges], step)
        if at and ranges[at - 1][1] + 1 >= step:
            ranges[at - 1][1] = max(ranges[at - 1][1], step)
            at -= 1
        else:
            ranges.insert(at, [step, step])
        while at + 1 < len(ranges) and ranges[at][1] + 1 >= ranges[at + 1][0]:
            ranges[at][1] = max(ranges[at][1], ranges.pop(at + 1)[1])
        if len(ranges) > MAX_STEP_RANGES:
            gaps = [ranges[i + 1][0] - ranges[i][1] for i in range(len(ranges) - 1)]
            i = gaps.index(min(gaps))
            ranges[i][1] = ranges.pop(i + 1)[1]

    @classmethod
    def of(cls, steps: list[int | None]) -> StepRanges:
        ranges = cls()
        for step in steps:
            ranges.add(step)
        return ranges

    def __bool__(self) -> bool:
        return bool(self.ranges)


def describe_steps(ranges: list[list[int]]) -> str:
    """``[[5, 9], [12, 12]]`` -> ``"steps 5-9, 12"``."""
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in ranges]
    return ("step " if parts == [str(ranges[0][0])] else "steps ") + ", ".join(parts) if parts else ""


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
        self.in_flight: list[int | None] = []  # steps of the events of the call in progress
        self.progress_at = time.monotonic()  # when a call last returned (or the lane was closed)
        self.last_step: int | None = None  # last step accepted (monotonic trackers)
        #: delivered: events whose call returned; failed: events whose call raised; errors: every
        #: exception (start and finish too); the keys of DROP_REASONS count events that never
        #: reached the tracker; skipped/truncated_values: values the tracker said it could not record.
        self.counts = {"delivered": 0, "failed": 0, "errors": 0, "queue_full": 0, "rejected_steps": 0,
                       "abandoned": 0, "not_started": 0, "crashed": 0, "after_end": 0, "unsupported": 0,
                       "skipped_values": 0, "truncated_values": 0}
        self.dropped_steps: dict[str, StepRanges] = collections.defaultdict(StepRanges)
        self.values_said: set[str] = set()
        self.last_error: str | None = None
        self.state = "running"
        tracker._value_loss_sink = self._value_not_recorded
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
                self._drop("crashed", [step])
                return False
            if self.closed:
                self._drop("after_end", [step])
                first = self.counts["after_end"] == 1
                if first:
                    self.warn(f"{method}() after end_training() finished this tracker: not recorded ({step_text(step)}); "
                              "log before end_training(), or call init_trackers() to start a new run (said once)")
                return False
            if step is not None and self.tracker.monotonic_steps:
                if self.last_step is not None and step < self.last_step:
                    self._drop("rejected_steps", [step])
                    rejected = self.last_step
                else:
                    self.last_step, rejected = step, None
            else:
                rejected = None
            if rejected is None and len(self.events) >= self.capacity:
                self._drop("queue_full", [step])
                full = True
            else:
                full = False
                if rejected is None:
                    self.events.append((method, args, dict(kwargs), step))
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
                self.progress_at = time.monotonic()  # the stall clock starts when the wait does
                self.events.append(_STOP)
                self.cond.notify()

    def join(self, stall_timeout: float) -> None:
        """Wait for the worker to finish for as long as it makes progress: give up (abandon it)
        only once no call has returned for ``stall_timeout`` seconds — stuck, not slow."""
        while True:
            with self.cond:
                remaining = self.progress_at + stall_timeout - time.monotonic()
            if remaining <= 0:
                break
            self.thread.join(remaining)
            if not self.thread.is_alive():
                return
        with self.cond:
            if not self.thread.is_alive():
                return
            self.abandoned = True
            steps = [e[3] for e in self.events if e is not _STOP] + self.in_flight  # the in-flight outcome is lost
            self._drop("abandoned", steps)
            self.events.clear()
            busy = self._busy_text()
            self.state = "abandoned"
            self.cond.notify()
        covered = describe_steps(StepRanges.of(steps).ranges)
        logger.warning("tracker %r: stuck — no call returned for %.1f s%s; %d event(s) dropped%s, its thread is "
                       "left behind", self.name, stall_timeout, busy, len(steps), f" ({covered})" if covered else "")

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
            steps = {reason: [list(r) for r in ranges.ranges] for reason, ranges in self.dropped_steps.items() if ranges}
        dropped = sum(counts[k] for k in DROP_REASONS)
        return {"state": state, "delivered": counts["delivered"], "dropped": dropped, **counts,
                "dropped_steps": steps, "last_error": last_error}

    def _drop(self, reason: str, steps: list[int | None]) -> None:
        """Count events lost for ``reason`` and the steps they covered (the caller holds the lock)."""
        self.counts[reason] += len(steps)
        ranges = self.dropped_steps[reason]
        for step in steps:
            ranges.add(step)

    def _value_not_recorded(self, name: str, type_name: str, why: str, truncated: bool) -> None:
        """The sink of :meth:`Tracker.value_not_recorded`: counted always, said once per name."""
        with self.cond:
            self.counts["truncated_values" if truncated else "skipped_values"] += 1
            first = name not in self.values_said
            self.values_said.add(name)
        if first:
            self.warn(f"value {name!r} ({type_name}) is {'truncated' if truncated else 'not recorded'}: {why} "
                      "(said once per name)")

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
            lost = [e[3] for e in self.events if e is not _STOP] + self.in_flight
            self.events.clear()
            self._drop("crashed", lost)
            self.counts["errors"] += 1
            self.last_error, self.state, self.closed = text, "crashed", True
            if not self.started.is_set():
                self.start_error = text
        self.started.set()
        covered = describe_steps(StepRanges.of(lost).ranges)
        logger.error("tracker %r: %s; %d queued event(s) dropped%s, later events are dropped too", self.name, text,
                     len(lost), f" ({covered})" if covered else "")

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
            method, args, kwargs, step = event
            if self.start_error is not None:
                with self.cond:
                    self._drop("not_started", [step])
                continue
            steps = [step]
            if method == "log" and self.tracker.supports("log_many"):
                batch = [LogEvent(*args)]
                with self.cond:
                    batch += self._take_batch(kwargs, steps)
                method, args = "log_many", (batch,)
            if self._call(method, args, kwargs, steps):
                with self.cond:
                    if self.abandoned:  # counted as abandoned while it was in flight
                        return
                    self.counts["delivered"] += len(steps)

    def _take_batch(self, kwargs: Mapping[str, Any], steps: list[int | None]) -> list[LogEvent]:
        """The ``log`` events right behind the one taken, with the same ``kwargs``, up to the
        tracker's ``max_batch_events`` (the caller holds the lock; ``steps`` gets theirs)."""
        taken: list[LogEvent] = []
        limit = max(1, int(self.tracker.max_batch_events)) - 1
        while self.events and len(taken) < limit:
            event = self.events[0]
            if event is _STOP or event[0] != "log" or event[2] != kwargs:
                break
            self.events.popleft()
            taken.append(LogEvent(*event[1]))
            steps.append(event[3])
        return taken

    def _call(self, method: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
              steps: list[int | None] | None = None) -> bool:
        """Call the tracker; ``steps``: those of the events the call carries (counted failed if it raises)."""
        steps = steps or []
        with self.cond:
            if self.abandoned:
                return False
            self.busy_since, self.busy_with, self.in_flight = time.monotonic(), method, list(steps)
        try:
            getattr(self.tracker, method)(*args, **kwargs)
            return True
        except BaseException as exc:
            text = _describe(exc)
            with self.cond:
                if self.abandoned:
                    return False
                self.counts["errors"] += 1
                self._drop("failed", steps)
                self.last_error = text
            what = "failed to start; its events will be dropped" if method == "start" else f"{method}() raised"
            self.warn(f"{what}: {text}")
            return False
        finally:
            with self.cond:
                self.busy_since = self.busy_with = None
                self.in_flight = []
                self.progress_at = time.monotonic()


def _describe(exc: BaseException) -> str:
    """``Type: message``, also for an exception whose ``__str__`` itself fails."""
    try:
        message = str(exc)
    except BaseException:
        message = "<unprintable>"
    return f"{type(exc).__name__}: {message}"


def step_text(step: int | None) -> str:
    return "no step" if step is None else f"step {step}"


__all__ = ["DROP_REASONS", "MAX_STEP_RANGES", "WARNING_BURST", "WARNING_INTERVAL", "StepRanges", "describe_steps"]
