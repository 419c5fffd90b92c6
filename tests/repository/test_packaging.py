"""Packaging facts that editable installs would hide: lockstep versions, extras, pins, boundaries."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import tomllib
import torchrig

REPO = pathlib.Path(__file__).resolve().parents[2]
PLUGINS = {"ddp": "torchrig-ddp", "fsdp": "torchrig-fsdp", "deepspeed": "torchrig-deepspeed", "trackers": "torchrig-trackers",
           "ray": "torchrig-ray", "fp8": "torchrig-fp8", "ft": "torchrig-ft"}


def load(path: pathlib.Path) -> dict:
    return tomllib.loads(path.read_text())


def test_layout_is_exactly_the_documented_one():
    for path in ["pyproject.toml", "core/pyproject.toml", "tests", "examples", *(f"plugins/{p}/pyproject.toml" for p in PLUGINS)]:
        assert (REPO / path).exists(), path
    assert "project" not in load(REPO / "pyproject.toml"), "the workspace root must not be a distribution"


def test_versions_move_in_lockstep():
    version = torchrig.__version__
    core = load(REPO / "core/pyproject.toml")["project"]
    assert core["name"] == "torchrig"
    assert core["dynamic"] == ["version"]  # read from torchrig/_version.py
    for directory, name in PLUGINS.items():
        project = load(REPO / f"plugins/{directory}/pyproject.toml")["project"]
        assert project["name"] == name
        assert project["version"] == version, f"{name} is {project['version']}, torchrig is {version}"
        assert f"torchrig=={version}" in project["dependencies"], f"{name} must pin torchrig=={version}"
        init = (REPO / f"plugins/{directory}/src/{name.replace('-', '_')}/__init__.py").read_text()
        assert f'__version__ = "{version}"' in init
    pins = re.findall(r"torchrig-[a-z]+(?:\[[a-z,]+\])?==([0-9.]+)", (REPO / "core/pyproject.toml").read_text())
    assert pins and set(pins) == {version}


def test_core_extras_and_default_ddp():
    core = load(REPO / "core/pyproject.toml")["project"]
    extras = core["optional-dependencies"]
    assert {"fsdp", "deepspeed", "tensorboard", "wandb", "mlflow", "trackers", "fp8", "all", "bench"} <= set(extras)
    # every plugin extra is also in `all`
    for extra, plugin in (("fsdp", "torchrig-fsdp"), ("deepspeed", "torchrig-deepspeed"), ("ray", "torchrig-ray"),
                          ("fp8", "torchrig-fp8")):
        assert extras[extra] == [f"{plugin}=={torchrig.__version__}"] and extras[extra][0] in extras["all"], extra
    fp8 = load(REPO / "plugins/fp8/pyproject.toml")["project"]
    assert any(dep.startswith("torchao") for dep in fp8["dependencies"])
    assert not any(dep.startswith("torchao") for dep in core["dependencies"])
    assert not any(dep.startswith("torch") for dep in extras["bench"]), "the bench extra must not pull another torch"
    assert any(dep.startswith("torchrig-ddp") for dep in core["dependencies"]), "`pip install torchrig` must give DDP"
    deepspeed = load(REPO / "plugins/deepspeed/pyproject.toml")["project"]
    assert any(dep.startswith("deepspeed") for dep in deepspeed["dependencies"])
    assert not any(dep.startswith("deepspeed") for dep in core["dependencies"])


def test_dev_install_pins_cpu_torch_and_installs_plugins_from_local_paths():
    lines = [line.strip() for line in (REPO / "requirements-dev.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    assert "torch==2.13.0" in lines
    for directory in ["core[test,examples]", *(f"plugins/{p}" for p in PLUGINS)]:
        assert f"-e ./{directory}" in lines


def test_core_source_never_names_a_plugin_package():
    offenders = []
    for path in (REPO / "core/src/torchrig").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*(from|import)\s+torchrig_(ddp|fsdp|deepspeed|trackers|ray|fp8|ft)\b", line):
                offenders.append(f"{path.relative_to(REPO)}:{number}")
    assert not offenders, offenders


@pytest.mark.multiprocess
def test_every_manifest_module_is_torch_free():
    code = (
        "import sys\n"
        "from torchrig.testing import make_host\n"
        "host = make_host()\n"
        "print([i.key for i in host.plugins() if i.manifest is not None] and 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "False", result.stdout + result.stderr


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Test", 1)[1].split("```bash", 1)[1].split("```", 1)[0].strip()
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd ", "export "))]
    assert ci[-1:] == [block], f"README test command {block!r} differs from .ci/run's last line {ci!r}"
    # before it only the system packages of the Slurm/MPI tests, installed tolerantly: never a CI failure
    assert all("apt-get install" in line and "|| echo" in line for line in ci[:-1]), ci
