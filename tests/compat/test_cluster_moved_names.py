"""The 0.1 names of ``torchrig.builtins.clusters`` (a module then, a package of one module per environment
since 0.2) still resolve for one release, each to the object in its new module with a DeprecationWarning naming
that module; nothing in the repository uses them (so import-linter sees every real dependency); the changelog
lists them. No processes."""

from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest
import torchrig.builtins.clusters as clusters_package

ROOT = Path(__file__).resolve().parents[2]

#: ``torchrig.builtins.clusters.__all__`` in 0.1 -> the module each name lives in since 0.2
OLD_NAMES = {
    "ELASTIC_RUN_ID": "torchrig.builtins.clusters.torchelastic",
    "ELASTIC_VARIABLES": "torchrig.builtins.clusters.torchelastic",
    "TorchElasticCluster": "torchrig.builtins.clusters.torchelastic",
    "started_by_elastic": "torchrig.builtins.clusters.torchelastic",
    "SLURM_INTERACTIVE_JOB_NAMES": "torchrig.builtins.clusters.slurm",
    "SlurmCluster": "torchrig.builtins.clusters.slurm",
    "detect_slurm": "torchrig.builtins.clusters.slurm",
    "slurm_launch_mode": "torchrig.builtins.clusters.slurm",
    "slurm_master_port": "torchrig.builtins.clusters.slurm",
    "slurm_task_recognised": "torchrig.builtins.clusters.slurm",
    "srun_command": "torchrig.builtins.clusters.slurm",
    "expand_hostlist": "torchrig.builtins.clusters.slurm_hostlist",
    "iter_hostlist": "torchrig.builtins.clusters.slurm_hostlist",
    "parse_tasks_per_node": "torchrig.builtins.clusters.slurm_hostlist",
    "MPICluster": "torchrig.builtins.clusters.mpi",
    "detect_mpi": "torchrig.builtins.clusters.mpi",
    "mpi_hands_off": "torchrig.builtins.clusters.mpi",
    "mpirun_command": "torchrig.builtins.clusters.mpi",
    "LocalCluster": "torchrig.builtins.clusters.local",
}


@pytest.mark.parametrize("name", sorted(OLD_NAMES))
def test_a_0_1_name_resolves_to_its_new_home_with_a_deprecation_warning(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(clusters_package, name)
    assert value is getattr(importlib.import_module(OLD_NAMES[name]), name)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any(f"torchrig.builtins.clusters.{name}" in m and OLD_NAMES[name] in m for m in messages), messages


def test_an_unknown_name_is_an_attribute_error_naming_the_modules():
    with pytest.raises(AttributeError, match="torchrig.builtins.clusters.*no attribute 'SlurmClusterr'.*slurm"):
        clusters_package.SlurmClusterr  # noqa: B018


def test_nothing_in_the_repository_imports_from_the_package_itself():
    offenders = []
    for top in ("core", "plugins", "examples", "tests", "benchmarks", "docs"):
        for path in (ROOT / top).rglob("*.py"):
            if {"build", "__pycache__", ".venv"} & set(path.relative_to(ROOT).parts):
                continue
            text = path.read_text()
            if "torchrig.builtins.clusters import" not in text:
                continue  # parse only the files that could hold such an import
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, ast.ImportFrom) and node.module == "torchrig.builtins.clusters" and not any(
                        alias.name in {"torchelastic", "slurm", "slurm_hostlist", "mpi", "env", "process_group",
                                       "local", "handoff_options", "cluster_environment"} for alias in node.names):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"import these names from their modules (docs/changelog.md): {offenders}"


def test_the_changelog_lists_where_each_name_went():
    changelog = (ROOT / "docs" / "changelog.md").read_text()
    rows = [line for line in changelog.splitlines() if line.startswith("| `torchrig.builtins.clusters.")]
    for name, module in OLD_NAMES.items():
        assert any(name in row and row.rstrip().endswith(f"| `{module}` |") for row in rows), name
