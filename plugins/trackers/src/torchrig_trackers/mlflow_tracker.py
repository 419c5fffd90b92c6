"""The ``mlflow`` tracker: one MLflow run per job, through ``MlflowClient`` (no global active run).

Where the run goes, first that applies: ``init_kwargs["mlflow"]["tracking_uri"]``, the
``MLFLOW_TRACKING_URI`` variable, else a local SQLite store ``<logging_dir>/mlflow.db`` (the
current directory stands for an unset ``logging_dir``) with artifacts in
``<logging_dir>/mlartifacts`` — MLflow's own recommended local backend, kept beside the run's
other logs. The experiment is ``<project_name>`` (or ``MLFLOW_EXPERIMENT_NAME``), created if
missing. MLflow records any step order: steps are written as given.

Batched within MLflow's per-call limits: the hyperparameters go in ``log_batch`` calls of at most
100 params, and every ``log`` event waiting in the queue goes in ``log_batch`` calls of at most
1000 metrics (:meth:`MLflowTracker.log_many`), so a slow server costs one round trip per batch.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from torchrig.plugin import LogEvent, RunContext, Tracker, as_scalar, flatten, hookimpl, jsonable

#: MLflow's limits (mlflow.utils.validation): params per batch, metrics per batch, key length.
PARAMS_PER_BATCH, METRICS_PER_BATCH, MAX_KEY_LENGTH, MAX_PARAM_LENGTH = 100, 1000, 250, 6000


def mlflow_key(name: str) -> str:
    """A name MLflow accepts: alphanumerics, ``_ - . / :`` and spaces; others become ``_``."""
    key = re.sub(r"[^/\w.\- :]", "_", name).strip("/") or "_"
    return key[:MAX_KEY_LENGTH]


class KeyTable:
    """Names to MLflow keys, one to one for the whole run: a name whose sanitised key another
    name already holds gets ``"<key>_2"``, ``_3``... — never a duplicate key (MLflow refuses
    the whole batch) nor two series merged into one."""

    def __init__(self) -> None:
        self.keys: dict[str, str] = {}
        self.taken: set[str] = set()

    def __call__(self, name: str) -> str:
        key = self.keys.get(name)
        if key is None:
            base = key = mlflow_key(name)
            number = 1
            while key in self.taken:
                number += 1
                suffix = f"_{number}"
                key = base[:MAX_KEY_LENGTH - len(suffix)] + suffix
            self.keys[name] = key
            self.taken.add(key)
        return key


class MLflowTracker(Tracker):
    """``store_init_configuration``: every flattened hyperparameter as a param (text; one longer
    than MLflow's limit is truncated, and said); ``log``/``log_many``: numbers as metrics
    (``log_batch``), other values skipped (counted, said once per name);
    ``log_images``: ``log_image(key=..., step=...)`` per image (numpy HWC arrays or PIL
    images); ``log_table``: ``log_table`` into ``<table_name>.json``; ``finish``:
    ``set_terminated``. ``get_tracker("mlflow", unwrap=True)`` is the ``mlflow.entities.Run``;
    ``.client`` is the ``MlflowClient``."""

    name = "mlflow"
    requires_logging_directory = False

    def __init__(self, experiment_name: str, logging_dir: str | None = None, *, tracking_uri: str | None = None,
                 run_id: str | None = None, run_name: str | None = None, tags: Mapping[str, Any] | None = None,
                 description: str | None = None) -> None:
        self.experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment_name
        self.directory = logging_dir if logging_dir else os.getcwd()
        self.tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.run_id = run_id
        self.run_name = run_name
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.description = description
        self.client: Any = None
        self.run: Any = None
        self.param_keys = KeyTable()
        self.metric_keys = KeyTable()

    @property
    def tracker(self) -> Any:
        return self.run

    def start(self) -> None:
        from mlflow.tracking import MlflowClient

        artifact_location = None
        uri = self.tracking_uri
        if not uri:
            os.makedirs(self.directory, exist_ok=True)
            uri = "sqlite:///" + os.path.abspath(os.path.join(self.directory, "mlflow.db"))
            artifact_location = "file://" + os.path.abspath(os.path.join(self.directory, "mlartifacts"))
        self.client = MlflowClient(tracking_uri=uri)
        if self.run_id:  # continue an existing run
            self.run = self.client.get_run(self.run_id)
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(self.experiment_name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(self.experiment_name, artifact_location=artifact_location))
        tags = dict(self.tags)
        if self.description:
            tags.setdefault("mlflow.note.content", self.description)
        self.run = self.client.create_run(experiment_id, run_name=self.run_name, tags=tags)
        self.run_id = self.run.info.run_id

    def store_init_configuration(self, values: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = []
        for key, value in flatten(values).items():
            plain = jsonable(value)
            text = plain if isinstance(plain, str) else ("" if plain is None else str(plain))
            if len(text) > MAX_PARAM_LENGTH:
                self.value_not_recorded(key, value, f"MLflow params hold at most {MAX_PARAM_LENGTH} characters "
                                        f"(this one has {len(text)})", truncated=True)
            params.append(Param(self.param_keys(key), text[:MAX_PARAM_LENGTH]))
        for chunk in _chunks(params, PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=chunk)

    def log(self, values: Mapping[str, Any], step: int | None, **kwargs: Any) -> None:
        self.log_many([LogEvent(values, step)], **kwargs)

    def log_many(self, events: Sequence[LogEvent], **kwargs: Any) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = []
        for values, step in events:
            for key, value in flatten(values).items():
                scalar = as_scalar(value)
                if scalar is None:
                    self.value_not_recorded(key, value, "MLflow metrics are numbers")
                    continue
                metrics.append(Metric(self.metric_keys(key), float(scalar), now, step or 0))
        for chunk in _chunks(metrics, METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=chunk, **kwargs)

    def log_images(self, values: Mapping[str, Any], step: int | None, **kwargs: Any) -> None:
        for key, value in values.items():
            for image in value if isinstance(value, (list, tuple)) else [value]:
                self.client.log_image(self.run_id, image, key=self.metric_keys(key), step=step, **kwargs)

    def log_table(self, table_name: str, columns: list[str] | None = None, data: list[list[Any]] | None = None,
                  dataframe: Any = None, step: int | None = None, **kwargs: Any) -> None:
        if dataframe is None:
            names = list(columns or [])
            rows = list(data or [])
            dataframe = {name: [row[i] for row in rows] for i, name in enumerate(names)}
        self.client.log_table(self.run_id, data=dataframe, artifact_file=f"{mlflow_key(table_name)}.json", **kwargs)

    def finish(self) -> None:
        if self.run_id is not None and self.client is not None:
            self.client.set_terminated(self.run_id)


def _chunks(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


class MLflowPlugin:
    """Runtime entry point ``mlflow``: one :class:`MLflowTracker`; ``init_kwargs["mlflow"]``:
    ``tracking_uri``, ``run_id`` (continue a run), ``run_name``, ``tags``, ``description``."""

    @hookimpl
    def torchrig_create_trackers(self, run: RunContext, project_name: str, logging_dir: str | None,
                                 init_kwargs: Mapping[str, Mapping[str, Any]]) -> list[Tracker]:
        return [MLflowTracker(project_name, logging_dir, **init_kwargs.get("mlflow", {}))]


__all__ = ["MLflowPlugin", "MLflowTracker", "mlflow_key"]
