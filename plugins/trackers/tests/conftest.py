"""Fixtures shared by the trackers' tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def mlflow_schema_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store with its schema, created once: MLflow's migrations take
    ~1.5 s on 2 cores, paid by every test whose tracker creates its own store. A store created
    from nothing stays covered (TestMLflowContract, test_mlflow_run_is_read_back_by_the_mlflow_client)."""
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("mlflow-schema") / "mlflow.db"
    MlflowClient(tracking_uri="sqlite:///" + str(path)).search_experiments()
    return path


@pytest.fixture
def mlflow_store(tmp_path: Path, mlflow_schema_store: Path) -> Path:
    """``tmp_path/project/mlflow.db``, where the MLflow tracker of a run with ``project_dir=tmp_path/project``
    keeps its runs: a copy of the schema-only store, as a tracking server's store exists before a run."""
    project = tmp_path / "project"
    project.mkdir()
    return Path(shutil.copy(mlflow_schema_store, project / "mlflow.db"))
