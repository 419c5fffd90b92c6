"""The tracker hub: the core's tracking policy, applied to every tracker of a run.

Tracker plugins answer ``torchrig_create_trackers`` with :class:`Tracker` objects; users may
also pass their own ``Tracker`` instances in ``log_with``. The policy that must be the same for
every tracker lives here, in the core, not in each tracker (see docs/trackers.md):

* **Once per run.** Trackers run on the main process only (a tracker instance that sets
  ``main_process_only = False`` also runs on the other ranks): a job makes one run per tracker,
  not one per rank.
* **Never fatal, never in the way.** Each tracker has its own bounded queue and worker thread.
  ``log()`` snapshots the values and returns; a tracker that raises, or blocks (network down),
  loses events — counted, with rate-limited warnings — but never stops or slows training.
  ``end_training()`` waits for each tracker to drain and finish while it makes progress,
  returns what each delivered and dropped (and at which steps), and records it in this rank's
  status file (merged by ``torchrig launch`` into ``run_status.json``).
* **One step model.** ``step`` is an integer >= 0 (usually the optimizer step); ``step=None``
  means "the step after the last one logged" (0 first), so every tracker sees the same step. A
  step lower than the last one is passed on unchanged to trackers that accept it (csv, jsonl,
  TensorBoard, MLflow record it as given) and refused — counted as dropped — by trackers that
  declare ``monotonic_steps = True`` (W&B ignores such data).
* **Hyperparameters once.** ``init_trackers`` hands each tracker, once, the user's ``config``
  plus a compact summary of the torchrig configuration (``torchrig``; every key with
  ``tracker_hyperparameters: full``) and where each non-default value came from
  (``torchrig_sources``), see :func:`run_hyperparameters`.
* **Slow is not stuck.** Queued ``log`` events reach a tracker that can batch in one call
  (``Tracker.log_many``); ``end_training`` waits while calls keep returning and gives up on a
  tracker only after ``wait_timeout`` seconds without one. Every lost event is counted with the
  steps it covered; every value a tracker cannot record is counted and said once.

Torch-free at import (the configuration layer imports :class:`Tracker`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import operator
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from torchrig._version import __version__
from torchrig.config.resolve import Layer, Schema
from torchrig.plugin.tracker import Tracker, as_scalar, flatten, jsonable
from torchrig.resilience import run_status
from torchrig.tracking.lane import DROP_REASONS, WARNING_BURST, WARNING_INTERVAL, _Lane, describe_steps, step_text

if TYPE_CHECKING:  # pragma: no cover
    from torchrig.host.run import RunContext

logger = logging.getLogger("torchrig.tracking")


def _snapshot(value: Any) -> Any:
    """A copy that later in-place changes by the training loop cannot alter: tensors are
    detached clones (no device synchronisation), numpy arrays copies, containers rebuilt."""
    if isinstance(value, (str, bytes, int, float, bool)) or value is None:
        return value
    if isinstance(value, Mapping):
        return {k: _snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_snapshot(v) for v in value)
    detach = getattr(value, "detach", None)
    if callable(detach) and callable(getattr(value, "clone", None)):
        return value.detach().clone()
    if type(value).__module__ == "numpy" and callable(getattr(value, "copy", None)):
        return value.copy()
    return value


#: The largest step: TensorBoard, MLflow and W&B store steps as int64 (MLflow fails the whole batch).
MAX_STEP = 2**63 - 1


def _resolve_step(step: Any, last: int) -> int:
    if step is None:
        return last + 1
    if isinstance(step, bool):
        raise TypeError(f"step must be an integer >= 0 or None, got {step!r}")
    try:
        value = operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an integer >= 0 or None, got {type(step).__name__} {step!r}") from None
    if value < 0:
        raise ValueError(f"step must be >= 0, got {value}")
    if value > MAX_STEP:
        raise ValueError(f"step must be <= 2**63-1 (the int64 the trackers store), got {value}")
    return value


# --------------------------------------------------------------------------------------------
# one tracker: queue, worker thread, counters


# --------------------------------------------------------------------------------------------
# what users hold


class TrackerHandle:
    """A tracker of this run, as ``get_tracker(name)`` and ``trackers`` give it.

    ``log``, ``log_images``, ``log_table`` and ``store_init_configuration`` go through the
    tracker's queue, like ``Accelerator.log`` (never blocking, never raising the tracker's
    errors); ``tracker`` is the library's own object (waits for ``start``); other attributes
    are the :class:`Tracker`'s own (``handle.run_dir``...).
    """

    def __init__(self, hub: TrackerHub, lane: _Lane) -> None:
        self._hub = hub
        self._lane = lane

    @property
    def name(self) -> str:
        return self._lane.name

    @property
    def tracker(self) -> Any:
        unwrapped = self._lane.unwrap()
        return BlankTracker(self.name) if unwrapped is None else unwrapped

    @property
    def unwrapped(self) -> Tracker:
        """The :class:`Tracker` object itself (its methods run on the calling thread)."""
        return self._lane.tracker

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self._lane.submit("store_init_configuration", (_snapshot(dict(values)),), {})

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        values, step = self._hub._prepare(values, step)
        self._lane.submit("log", (values, step), kwargs, step)

    def log_images(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        values, step = self._hub._prepare(values, step)
        self._lane.submit("log_images", (values, step), kwargs, step)

    def log_table(self, table_name: str, columns: list[str] | None = None, data: list[list[Any]] | None = None,
                  dataframe: Any = None, step: int | None = None, **kwargs: Any) -> None:
        _, step = self._hub._prepare({}, step)
        payload = dict(kwargs, columns=_snapshot(columns), data=_snapshot(data), dataframe=_snapshot(dataframe), step=step)
        self._lane.submit("log_table", (table_name,), payload, step)

    def finish(self) -> dict[str, Any]:
        """Finish this tracker now (``end_training`` finishes every tracker); returns its report."""
        self._lane.close()
        self._lane.join(float(self._lane.tracker.wait_timeout))
        return self._lane.report()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._lane.tracker, name)

    def __repr__(self) -> str:
        return f"<TrackerHandle {self.name!r} ({type(self._lane.tracker).__qualname__})>"


class BlankTracker(Tracker):
    """The stand-in ``get_tracker`` returns where the tracker does not run (ranks other than
    the main process, or a tracker that failed to start): every method and attribute is a
    no-op, so code written for the main process runs harmlessly everywhere."""

    def __init__(self, name: str) -> None:
        self.name = name

    def log(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Ignored."""

    def log_images(self, values: Mapping[str, Any], step: int | None = None, **kwargs: Any) -> None:
        """Ignored."""

    def log_table(self, table_name: str, columns: list[str] | None = None, data: list[list[Any]] | None = None,
                  dataframe: Any = None, step: int | None = None, **kwargs: Any) -> None:
        """Ignored."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _ignore

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<BlankTracker {self.name!r}: does not run on this process>"


def _ignore(*args: Any, **kwargs: Any) -> None:
    """What every call on a :class:`BlankTracker` does: nothing."""


# --------------------------------------------------------------------------------------------
# the hub: the policy


class TrackerHub:
    """The run's trackers and the core's tracking policy (one per Accelerator).

    The Accelerator's ``init_trackers``/``log``/``get_tracker``/``trackers``/``end_training``
    delegate here. Every rank validates the same things (names, ``init_kwargs``, steps) so a
    mistake fails everywhere alike; only the process that runs a tracker creates and feeds it.
    """

    def __init__(self, run: RunContext) -> None:
        self._run = run
        self._lanes: list[_Lane] = []
        self._handles: list[TrackerHandle] = []
        self._names: list[str] = []  # every tracker of the run, on whichever rank it runs
        self._last_step = -1
        self._initialised = False
        self._report: dict[str, dict[str, Any]] = {}
        self._atexit: Callable[[], None] | None = None
        self._finish_lock = threading.Lock()
        #: What end_training finished: events logged after it are counted there (after_end).
        self._finished: _FinishedRun | None = None
        self._said_before_init = False

    # -- queries ---------------------------------------------------------------------------

    @property
    def handles(self) -> list[TrackerHandle]:
        return list(self._handles)

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def get(self, name: str, unwrap: bool = False) -> Any:
        for handle in self._handles:
            if handle.name == name:
                return handle.tracker if unwrap else handle
        if name in self._names or (not self._initialised and name in self._requested_names()):
            return BlankTracker(name)  # runs on another process, or not started yet / finished
        known = self._names if self._initialised else self._requested_names()
        raise ValueError(f"{name!r} is not a tracker of this run; its trackers: {', '.join(known) or 'none'}"
                         + ("" if self._initialised else " (init_trackers() has not been called)"))

    # -- lifecycle -------------------------------------------------------------------------

    def init(self, project_name: str, config: Mapping[str, Any] | None = None,
             init_kwargs: Mapping[str, Mapping[str, Any]] | None = None, *, logging_dir: str | None = None) -> None:
        if self._initialised:
            raise RuntimeError("init_trackers() was already called for this Accelerator; call end_training() "
                               "before starting new tracker runs")
        if not isinstance(project_name, str) or not project_name:
            raise ValueError(f"init_trackers(project_name=...): expected a non-empty string, got {project_name!r}")
        if config is not None and not isinstance(config, Mapping):
            raise TypeError(f"init_trackers(config=...): expected a mapping of hyperparameters, got {type(config).__name__}")
        kwargs_by_tracker = self._check_init_kwargs(init_kwargs)
        instances = self._instances()
        plugin_names = self._requested_names(include_instances=False)
        names = plugin_names + [t.name for t in instances]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"log_with has several trackers named {', '.join(map(repr, duplicates))}; tracker names "
                             "must be unique (give your Tracker subclass another name)")
        unknown = sorted(set(kwargs_by_tracker) - set(names))
        if unknown:
            raise ValueError(f"init_trackers(init_kwargs=...) has entries for {', '.join(map(repr, unknown))}, which "
                             f"{'is' if len(unknown) == 1 else 'are'} not in log_with; trackers of this run: "
                             f"{', '.join(names) or 'none'}")
        main = self._run.cluster.is_main_process
        trackers: list[Tracker] = self._create_plugin_trackers(project_name, logging_dir, kwargs_by_tracker) if main else []
        trackers += [t for t in instances if main or not t.main_process_only]
        created = [t.name for t in trackers]
        clashes = sorted({n for n in created if created.count(n) > 1})
        if clashes:
            raise ValueError(f"several trackers of this run are named {', '.join(map(repr, clashes))}: "
                             f"{', '.join(type(t).__qualname__ for t in trackers if t.name in clashes)}")
        self._names = list(dict.fromkeys([*names, *created]))  # the same order on every rank
        hyperparameters = run_hyperparameters(self._run, config) if trackers else {}
        lanes = [_Lane(tracker) for tracker in trackers]
        for lane in lanes:
            lane.submit("store_init_configuration", (hyperparameters,), {})
        self._lanes = lanes
        self._handles = [TrackerHandle(self, lane) for lane in lanes]
        self._initialised = True
        self._report = {}
        self._finished = None
        if lanes:  # finished at exit if end_training is never called (holds the lanes, not the run)
            self._atexit = functools.partial(_finish_lanes, lanes)
            atexit.register(self._atexit)

    def log(self, values: Mapping[str, Any], step: int | None = None,
            log_kwargs: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        values, step = self._prepare(values, step)
        if not self._lanes:
            self._log_without_lanes(values, step)
            return
        per_tracker = log_kwargs or {}
        for lane in self._lanes:
            lane.submit("log", (values, step), per_tracker.get(lane.name, {}), step)

    def _log_without_lanes(self, values: dict[str, Any], step: int) -> None:
        """No tracker runs here: after end_training, count the event as lost (``after_end``) for
        each finished tracker (their report is rewritten at exit); before init_trackers, say once
        that nothing records it. Ranks that run no tracker lose nothing and say nothing."""
        if self._finished is not None:
            self._finished.count_late(values, step)
        elif not self._initialised and not self._said_before_init and self._requested_names():
            self._said_before_init = True
            logger.warning("log() before init_trackers(): no tracker runs yet, so %s is not recorded (nor any value "
                           "logged before init_trackers; said once)", step_text(step))

    def finish(self) -> dict[str, dict[str, Any]]:
        """Drain and finish every tracker (bounded by each one's ``wait_timeout``); the report
        ``{tracker: {state, delivered, dropped, errors, ...}}`` of this process."""
        with self._finish_lock:
            lanes, self._lanes, self._handles = self._lanes, [], []
            if self._atexit is not None:
                atexit.unregister(self._atexit)
                self._atexit = None
            if not self._initialised:  # finished already (or never started): the last report, updated
                if self._finished is not None:
                    self._report = self._finished.publish()
                return dict(self._report)
            self._initialised = False
            self._report = _finish_lanes(lanes)
            self._finished = _FinishedRun(lanes, self._report)
            return dict(self._report)

    # -- internals -------------------------------------------------------------------------

    def _prepare(self, values: Mapping[str, Any], step: Any) -> tuple[dict[str, Any], int]:
        if not isinstance(values, Mapping):
            raise TypeError(f"log(values=...): expected a mapping of name -> value, got {type(values).__name__}")
        bad = [k for k in values if not isinstance(k, str)]
        if bad:
            raise TypeError(f"log(values=...): names must be strings, got {bad[:3]!r}")
        resolved = _resolve_step(step, self._last_step)
        self._last_step = resolved
        return (_snapshot(dict(values)) if self._lanes else dict(values)), resolved

    def _log_with(self) -> list[Any]:
        return list(self._run.config.get("log_with") or [])

    def _instances(self) -> list[Tracker]:
        instances = [t for t in self._log_with() if not isinstance(t, str)]
        for tracker in instances:
            if not isinstance(tracker, Tracker):
                raise TypeError(f"log_with: {tracker!r} is neither a tracker name nor a torchrig.Tracker instance")
            if not tracker.supports("log"):
                raise TypeError(f"log_with: tracker {tracker.name!r} ({type(tracker).__qualname__}) does not implement "
                                "log(values, step, **kwargs)")
        return instances

    def _requested_names(self, include_instances: bool = True) -> list[str]:
        """Tracker plugins selected for this run (``"all"`` already expanded) and instances."""
        host = self._run.plugins
        names = [info.name for info in host.selected("tracker")] if host is not None else []
        if include_instances:
            names += [t.name for t in self._log_with() if isinstance(t, Tracker)]
        return names

    @staticmethod
    def _check_init_kwargs(init_kwargs: Mapping[str, Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
        if init_kwargs is None:
            return {}
        if not isinstance(init_kwargs, Mapping):
            raise TypeError("init_trackers(init_kwargs=...): expected {tracker name: {argument: value}}, "
                            f"got {type(init_kwargs).__name__}")
        out = {}
        for name, kwargs in init_kwargs.items():
            if not isinstance(kwargs, Mapping):
                raise TypeError(f"init_trackers(init_kwargs={{{name!r}: ...}}): expected a mapping of arguments for "
                                f"that tracker, got {type(kwargs).__name__}")
            out[str(name)] = dict(kwargs)
        return out

    def _create_plugin_trackers(self, project_name: str, logging_dir: str | None,
                                init_kwargs: Mapping[str, Mapping[str, Any]]) -> list[Tracker]:
        """``torchrig_create_trackers`` on the main process, one plugin at a time so an error
        names the plugin. Creating is cheap by contract (no I/O): an error here is a mistake in
        the arguments, reported at once."""
        host = self._run.plugins
        if host is None:
            return []
        created: list[Tracker] = []
        for owner, call in host.iter_impls("torchrig_create_trackers", run=self._run, project_name=project_name,
                                           logging_dir=logging_dir, init_kwargs=init_kwargs):
            try:
                trackers = call() or []
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"tracker plugin {owner!r}: {exc} (check init_kwargs[{owner.partition(':')[2]!r}])") from exc
            for tracker in trackers:
                if not isinstance(tracker, Tracker):
                    raise TypeError(f"tracker plugin {owner!r} returned {tracker!r} from torchrig_create_trackers; "
                                    "expected torchrig.Tracker instances")
                created.append(tracker)
        return created


def _finish_lanes(lanes: list[_Lane]) -> dict[str, dict[str, Any]]:
    """Close every lane and wait for each while it makes progress (all at once: a lane's stall
    clock starts when it is closed), abandoning one only after its tracker's ``wait_timeout``
    without a call returning; publish the report. Also run at interpreter exit for trackers
    never finished."""
    for lane in lanes:
        lane.close()
    for lane in lanes:
        lane.join(float(lane.tracker.wait_timeout))
    report = {lane.name: lane.report() for lane in lanes}
    if report:
        _publish(report)
    return report


class _FinishedRun:
    """The trackers ``end_training`` finished. Events logged afterwards are lost: each lane
    counts them (``after_end``, with their steps, said once), and the report is recorded again
    — by the next ``end_training`` or at interpreter exit."""

    def __init__(self, lanes: list[_Lane], report: dict[str, dict[str, Any]]) -> None:
        self.lanes = lanes
        self.report = report
        self.lock = threading.Lock()
        self.exit_hook = False

    def count_late(self, values: Mapping[str, Any], step: int) -> None:
        for lane in self.lanes:
            lane.submit("log", (values, step), {}, step)
        with self.lock:
            if not self.exit_hook:
                self.exit_hook = True
                atexit.register(self.publish)

    def publish(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            report = {lane.name: lane.report() for lane in self.lanes}
            if report == self.report:
                return report
            late = [f"tracker {name!r}: {row['after_end']} event(s) logged after end_training() were not recorded "
                    f"({describe_steps(row['dropped_steps'].get('after_end', []))})"
                    for name, row in report.items() if row["after_end"] != self.report.get(name, {}).get("after_end")]
            self.report = report
        run_status.record(trackers=report, **({"warnings": late} if late else {}))
        return report


def _publish(report: Mapping[str, Mapping[str, Any]]) -> None:
    """Warn about losses and record the report in this rank's status file (``torchrig launch``
    merges the warnings into ``run_status.json``)."""
    warnings = []
    for name, row in report.items():
        if row["dropped"] or row["errors"] or row["state"] != "finished" or row["skipped_values"] or row["truncated_values"]:
            message = loss_summary(name, row)
            warnings.append(message)
            logger.warning(message)
    run_status.record(trackers=dict(report), **({"warnings": warnings} if warnings else {}))


def loss_summary(name: str, row: Mapping[str, Any]) -> str:
    """One line for a tracker's report: its state, what it delivered, what it lost and at which steps."""
    steps = row.get("dropped_steps", {})
    detail = ", ".join(f"{row[k]} {k.replace('_', ' ')}" + (f": {describe_steps(steps[k])}" if steps.get(k) else "")
                       for k in DROP_REASONS if row[k])
    values = [f"{row[k]} values {what}" for k, what in (("skipped_values", "not recorded"),
                                                       ("truncated_values", "truncated")) if row[k]]
    last = f"; last error: {row['last_error']}" if row["last_error"] else ""
    return (f"tracker {name!r} {row['state']}: delivered {row['delivered']} events, dropped {row['dropped']} "
            f"({detail or 'none'})" + "".join(f"; {v}" for v in values) + last)


# --------------------------------------------------------------------------------------------
# hyperparameters


#: Core keys the summary always records, set or not (what a reader of a run asks first).
SUMMARY_KEYS = ("strategy", "mixed_precision", "gradient_accumulation_steps")


def run_hyperparameters(run: RunContext, user_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What ``store_init_configuration`` receives: the user's ``config``, plus

    * ``torchrig``: the resolved configuration, nested as a config file writes it. By default
      (``tracker_hyperparameters: summary``) a compact summary: :data:`SUMMARY_KEYS` and every
      value a source set (file, variable, flag, argument) — tens of keys, not hundreds, so a
      tracker that records them one by one (MLflow params) is not slowed down by defaults nobody
      chose. With ``full``: every core key, the sections of the core and of the plugins this run
      selected, and any other key a source set;
    * ``torchrig_sources``: for each value not at its default, where it came from
      (``"flag --mixed_precision"``, ``"config file run.yaml:3"``...);
    * ``torchrig_run``: the number of processes and the torchrig version.

    A user key with one of these names wins over torchrig's.
    """
    config = run.config
    full = config.get("tracker_hyperparameters", "summary") == "full"
    sources: Mapping[str, Any] = config.sources
    owners = Schema(run.plugins).section_owner if run.plugins is not None and full else {}
    selected = {info.key for info in run.plugins.plugins() if info.status.value == "selected"} if run.plugins and full else set()
    values: dict[str, Any] = {}
    origins: dict[str, Any] = {}
    for key in config:
        section, _, field = key.rpartition(".")
        source = sources.get(key)
        is_set = source is not None and source.layer is not Layer.DEFAULT
        if full:
            owner = owners.get(section, "the core")
            if section and not (is_set or owner == "the core" or owner in selected):
                continue
        elif not (is_set or key in SUMMARY_KEYS):
            continue
        value = config[key]
        if key == "log_with":
            value = [v if isinstance(v, str) else getattr(v, "name", type(v).__name__) for v in value or ()]
        _put(values, section, field, jsonable(value))
        if is_set:
            _put(origins, section, field, str(source))
    ours = {"torchrig": values, "torchrig_sources": origins,
            "torchrig_run": {"num_processes": run.cluster.world_size, "torchrig_version": __version__}}
    user = dict(user_config or {})
    return {**user, **{key: value for key, value in ours.items() if key not in user}}


def _put(target: dict[str, Any], section: str, field: str, value: Any) -> None:
    (target.setdefault(section, {}) if section else target)[field] = value


__all__ = [
    "DROP_REASONS", "SUMMARY_KEYS", "WARNING_BURST", "WARNING_INTERVAL", "BlankTracker", "Tracker", "TrackerHandle", "TrackerHub", "as_scalar", "flatten", "jsonable", "run_hyperparameters",
]
