"""The dependency-free trackers: ``csv`` and ``jsonl``.

Both write under ``<logging_dir>/<project_name>/`` (the current directory stands for an unset
``logging_dir``), append to an existing file (a resumed job continues its curve) and flush
after every event, so a crash loses nothing already logged.
"""

from __future__ import annotations

import csv
import json
import os
import time
from collections.abc import Mapping
from typing import IO, Any

from torchrig.plugin import RunContext, Tracker, as_scalar, flatten, hookimpl, jsonable


def run_directory(logging_dir: str | None, project_name: str) -> str:
    return os.path.join(logging_dir if logging_dir else os.getcwd(), project_name)


class CSVTracker(Tracker):
    """``metrics.csv``: one row per value — ``time,step,name,value`` (long format: names may
    appear at any step); ``hparams.csv``: ``name,value`` of the flattened hyperparameters.
    Nested values are flattened with ``/``; values that are not numbers or strings (images,
    tensors with several elements) are skipped — counted in the report, said once per name."""

    name = "csv"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | None = None, *, filename: str = "metrics.csv",
                 hparams_filename: str = "hparams.csv") -> None:
        self.directory = run_directory(logging_dir, run_name)
        self.path = os.path.join(self.directory, filename)
        self.hparams_path = os.path.join(self.directory, hparams_filename)
        self._file: IO[str] | None = None
        self._writer: Any = None

    @property
    def tracker(self) -> Any:
        return self._writer

    def start(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        new = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        self._file = open(self.path, "a", newline="", encoding="utf-8")  # noqa: SIM115 -- open for the run
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(["time", "step", "name", "value"])
            self._file.flush()

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        tmp = f"{self.hparams_path}.tmp"
        with open(tmp, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(["name", "value"])
            for key, value in flatten(values).items():
                value = jsonable(value)
                writer.writerow([key, value if isinstance(value, str) else json.dumps(value)])
        os.replace(tmp, self.hparams_path)

    def log(self, values: Mapping[str, Any], step: int | None, **kwargs: Any) -> None:
        assert self._file is not None, "start() was not called"
        now = time.time()
        for key, value in flatten(values).items():
            scalar = as_scalar(value)
            if scalar is None and not isinstance(value, str):
                self.value_not_recorded(key, value, "csv rows hold numbers and strings")
                continue
            self._writer.writerow([f"{now:.3f}", "" if step is None else step, key, value if scalar is None else scalar])
        self._file.flush()

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class JSONLTracker(Tracker):
    """``metrics.jsonl``: one JSON object per line, ``{"event": "start"|"config"|"log"|"finish",
    "time": ..., ...}``; ``log`` lines carry ``step`` and ``values`` (nested as given; tensors
    and arrays as lists)."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | None = None, *, filename: str = "metrics.jsonl") -> None:
        self.run_name = run_name
        self.directory = run_directory(logging_dir, run_name)
        self.path = os.path.join(self.directory, filename)
        self._file: IO[str] | None = None

    @property
    def tracker(self) -> Any:
        return self._file

    def start(self) -> None:
        os.makedirs(self.directory, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 -- open for the run
        self._write({"event": "start", "project": self.run_name})

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        self._write({"event": "config", "config": jsonable(values)})

    def log(self, values: Mapping[str, Any], step: int | None, **kwargs: Any) -> None:
        self._write({"event": "log", "step": step, "values": jsonable(values)})

    def finish(self) -> None:
        if self._file is not None:
            self._write({"event": "finish"})
            self._file.close()
            self._file = None

    def _write(self, record: dict[str, Any]) -> None:
        assert self._file is not None, "start() was not called"
        self._file.write(json.dumps({**record, "time": time.time()}) + "\n")
        self._file.flush()


class CSVPlugin:
    """Runtime entry point ``csv``: creates one :class:`CSVTracker` (``init_kwargs["csv"]``:
    ``filename``, ``hparams_filename``)."""

    @hookimpl
    def torchrig_create_trackers(self, run: RunContext, project_name: str, logging_dir: str | None,
                                 init_kwargs: Mapping[str, Mapping[str, Any]]) -> list[Tracker]:
        return [CSVTracker(project_name, logging_dir, **init_kwargs.get("csv", {}))]


class JSONLPlugin:
    """Runtime entry point ``jsonl``: creates one :class:`JSONLTracker` (``init_kwargs["jsonl"]``: ``filename``)."""

    @hookimpl
    def torchrig_create_trackers(self, run: RunContext, project_name: str, logging_dir: str | None,
                                 init_kwargs: Mapping[str, Mapping[str, Any]]) -> list[Tracker]:
        return [JSONLTracker(project_name, logging_dir, **init_kwargs.get("jsonl", {}))]


__all__ = ["CSVPlugin", "CSVTracker", "JSONLPlugin", "JSONLTracker", "run_directory"]
