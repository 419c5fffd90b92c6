"""The tracker contract: what every tracker plugin must do, as tests to inherit.

::

    from torchrig.testing.contracts import TrackerContract

    class TestMyTracker(TrackerContract):
        tracker = "neptune"
        environment = {"NEPTUNE_MODE": "offline"}

        def read_back(self, logging_dir, project):   # optional: what the library recorded
            return [(step, value) for step, value in my_reader(logging_dir, project, "loss")]

Checks, in the test process (no worker pool needed): creating the plugin's trackers does no I/O
and gives :class:`~torchrig.Tracker` objects named after the plugin that run on the main process
only; one run through the ``Accelerator`` delivers every event and finishes (and, with
:meth:`TrackerContract.read_back`, the library recorded every step); values of every kind the
core passes (numbers, strings, tensors, numpy scalars, nested mappings, NaN) are recorded or
skipped, never an error; a process that is not the main one creates nothing and writes nothing;
a tracker that cannot start (its directory is a file) costs its events, never the training.
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import pytest

STEPS = 5
PROJECT = "contract"


class TrackerContract:
    """Behaviour every tracker plugin must show. Subclass and set ``tracker``."""

    #: The tracker plugin's name (``log_with: [<name>]``).
    tracker: ClassVar[str] = ""
    #: Its ``init_trackers(init_kwargs={name: ...})`` entry for the tests.
    init_kwargs: ClassVar[Mapping[str, Any]] = {}
    #: Environment variables the tests need (offline modes...); ``{tmp}`` is the test's directory.
    environment: ClassVar[Mapping[str, str]] = {}

    def read_back(self, logging_dir: pathlib.Path, project: str) -> list[tuple[int, float]] | None:
        """``(step, value)`` of the metric ``loss`` as the tracker's library recorded it under
        ``logging_dir`` for ``project``; None (the default) when the contract should not read back."""
        return None

    @pytest.fixture(autouse=True)
    def _environment(self, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
        if not self.tracker:
            pytest.skip("TrackerContract is abstract: set `tracker` in the subclass")
        for key in [k for k in os.environ if k.startswith("TORCHRIG_")]:
            monkeypatch.delenv(key)
        monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path / "torchrig-home"))
        for key, value in self.environment.items():
            monkeypatch.setenv(key, value.format(tmp=tmp_path))
        yield

    # -- helpers -------------------------------------------------------------------------------

    def _run(self, *, rank: int = 0, world_size: int = 1) -> Any:
        from torchrig import ClusterInfo, PluginHost, RunContext
        from torchrig.testing.hosts import resolved_config

        host = PluginHost()
        host.select("tracker", self.tracker)
        cluster = ClusterInfo(rank=rank, local_rank=rank, world_size=world_size, local_world_size=world_size)
        return RunContext(config=resolved_config({"log_with": [self.tracker]}, host=host), plugins=host, cluster=cluster)

    def _hub(self, **kwargs: Any) -> Any:
        from torchrig.tracking.hub import TrackerHub

        return TrackerHub(self._run(**kwargs))

    # -- tests ---------------------------------------------------------------------------------

    def test_creating_trackers_does_no_io_and_gives_main_process_trackers(self, tmp_path: pathlib.Path) -> None:
        from torchrig import Tracker

        run = self._run()
        logging_dir = tmp_path / "logs"
        created = [t for answer in run.plugins.hook.torchrig_create_trackers(
            run=run, project_name=PROJECT, logging_dir=str(logging_dir), init_kwargs={self.tracker: dict(self.init_kwargs)})
            for t in answer or ()]
        assert created, f"tracker plugin {self.tracker!r} created no tracker"
        for tracker in created:
            assert isinstance(tracker, Tracker), tracker
            assert tracker.name == self.tracker, "a tracker is named after its plugin (log_with, init_kwargs, get_tracker)"
            assert tracker.supports("log"), "a tracker must implement log()"
            assert tracker.main_process_only, "a plugin's trackers run on the main process only (one run per job)"
        assert not logging_dir.exists(), "creating a tracker must not touch the disk (connect in Tracker.start)"

    def test_one_run_delivers_every_event_and_finishes(self, tmp_path: pathlib.Path) -> None:
        from torchrig import Accelerator

        accelerator = Accelerator(cpu=True, log_with=[self.tracker], project_dir=str(tmp_path / "project"))
        accelerator.init_trackers(PROJECT, config={"lr": 0.1, "layers": [2, 3]}, init_kwargs={self.tracker: dict(self.init_kwargs)})
        for step in range(STEPS):
            accelerator.log({"loss": 1.0 / (step + 1)}, step=step)
        report = accelerator.end_training()[self.tracker]
        assert report["state"] == "finished", report
        assert (report["delivered"], report["dropped"], report["errors"]) == (STEPS + 1, 0, 0), report
        recorded = self.read_back(tmp_path / "project", PROJECT)
        if recorded is not None:
            want = [(step, 1.0 / (step + 1)) for step in range(STEPS)]
            assert [(s, round(v, 6)) for s, v in recorded] == [(s, round(v, 6)) for s, v in want], recorded

    def test_values_of_every_kind_are_recorded_or_skipped_never_an_error(self, tmp_path: pathlib.Path) -> None:
        import numpy as np
        import torch

        from torchrig import Accelerator

        accelerator = Accelerator(cpu=True, log_with=[self.tracker], project_dir=str(tmp_path / "project"))
        accelerator.init_trackers(PROJECT, init_kwargs={self.tracker: dict(self.init_kwargs)})
        accelerator.log({"int": 3, "float": 0.5, "bool": True, "nan": math.nan, "text": "hello",
                         "scalar_tensor": torch.tensor(2.0), "vector": torch.ones(3), "numpy": np.float32(1.5),
                         "nested": {"a": 1.0, "b": {"c": 2}}}, step=0)
        accelerator.log({"loss": 0.25}, step=1)
        report = accelerator.end_training()[self.tracker]
        assert report["state"] == "finished" and report["errors"] == 0, report
        assert report["delivered"] == 3, report

    def test_other_processes_create_nothing_and_write_nothing(self, tmp_path: pathlib.Path) -> None:
        hub = self._hub(rank=1, world_size=2)
        logging_dir = tmp_path / "logs"
        hub.init(PROJECT, {"lr": 0.1}, {self.tracker: dict(self.init_kwargs)}, logging_dir=str(logging_dir))
        hub.log({"loss": 1.0}, step=0)
        assert hub.handles == [] and not hub.get(self.tracker), "rank 1 must get a stand-in, not a tracker"
        assert hub.names == [self.tracker]
        assert hub.finish() == {}
        assert not logging_dir.exists()

    def test_a_tracker_that_cannot_start_costs_its_events_not_the_training(self, tmp_path: pathlib.Path) -> None:
        blocker = tmp_path / "not-a-directory"
        blocker.write_text("a file where the logging directory should be")
        hub = self._hub()
        hub.init(PROJECT, {"lr": 0.1}, {self.tracker: dict(self.init_kwargs)}, logging_dir=str(blocker / "logs"))
        for step in range(3):
            hub.log({"loss": 1.0}, step=step)  # never raises, whatever the tracker does
        report = hub.finish()[self.tracker]
        assert report["state"] in ("finished", "failed"), report
        if report["state"] == "failed":
            assert report["errors"] >= 1 and report["dropped"] >= 3, report
        else:  # it wrote elsewhere (a library with its own fallback): then every event arrived
            assert report["delivered"] == 4, report


__all__ = ["TrackerContract"]
