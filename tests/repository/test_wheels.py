"""Wheel smoke test: build every first-party wheel, install them into a fresh virtual environment
without system site-packages and without an index, and ask the installed `torchrig` what it has.

Editable installs hide packaging mistakes (a module missing from the wheel, an entry point
pointing nowhere, an extra naming the wrong distribution); this test catches them.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import tomllib
import torchrig

REPO = pathlib.Path(__file__).resolve().parents[2]
DISTRIBUTIONS = ["core", "plugins/ddp", "plugins/fsdp", "plugins/deepspeed", "plugins/trackers", "plugins/ray",
                 "plugins/fp8", "plugins/ft"]


def sh(*command: str | os.PathLike, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout, **kwargs)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def third_party_requirements() -> list[str]:
    """The core's dependencies minus first-party wheels, with torch pinned to the local CPU wheel."""
    declared = tomllib.loads((REPO / "core" / "pyproject.toml").read_text())["project"]["dependencies"]
    third_party = [r for r in declared if not r.startswith("torchrig")]
    return ["torch==2.13.0" if r.startswith("torch") else r for r in third_party]


@pytest.mark.packaging
@pytest.mark.timeout(1200)
def test_wheels_install_into_a_clean_venv_and_list_the_first_party_plugins(tmp_path):
    dist = tmp_path / "dist"
    for directory in DISTRIBUTIONS:
        sh(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, REPO / directory)
    wheels = sorted(p.name for p in dist.glob("*.whl"))
    version = torchrig.__version__
    for name in ["torchrig", "torchrig_ddp", "torchrig_fsdp", "torchrig_deepspeed", "torchrig_trackers", "torchrig_ray",
                 "torchrig_fp8", "torchrig_ft"]:
        assert f"{name}-{version}-py3-none-any.whl" in wheels, wheels

    # Third-party dependencies come from a local wheelhouse (torch from the machine's local CPU
    # wheel), so the install itself runs with --no-index: only what we built and pinned.
    # The list is the core's own declared dependencies, so a new one cannot be forgotten here.
    wheelhouse = tmp_path / "wheelhouse"
    sh(sys.executable, "-m", "pip", "download", "--only-binary=:all:", "-d", wheelhouse, *third_party_requirements())

    venv = tmp_path / "venv"
    sh(sys.executable, "-m", "venv", venv)
    python, pip = venv / "bin" / "python", [venv / "bin" / "python", "-m", "pip"]
    flags = ["--no-index", "--find-links", dist, "--find-links", wheelhouse, "--disable-pip-version-check"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    sh(*pip, "install", *flags, "torchrig", "torchrig[fsdp,trackers]", env=env)
    # DeepSpeed itself ships only as an sdist, and Ray is hundreds of megabytes: the plugins' own
    # packaging is what is under test, so they come without their libraries (and say how to get them);
    # so does the fp8 plugin (torchao is a separate download) and the ft plugin (torchft is too).
    sh(*pip, "install", *flags, "--no-deps", "torchrig-deepspeed", "torchrig-ray", "torchrig-fp8", "torchrig-ft", env=env)

    no_site = sh(python, "-c", "import sys; print(sys.flags.no_site, any('site-packages' in p and 'venv' not in p for p in sys.path))", env=env)
    assert no_site.stdout.split()[1] == "False", "the venv must not see system site-packages"

    listing = json.loads(sh(venv / "bin" / "torchrig", "plugins", "--json", env=env).stdout)["plugins"]
    builtins = {(r["kind"], r["name"]) for r in listing if r["distribution"] == "torchrig" and r["version"] == version}
    assert {("strategy", "single"), ("precision", "no"), ("precision", "fp16"), ("precision", "bf16"),
            ("device", "cpu"), ("device", "cuda"), ("device", "mps")} <= builtins
    for row in listing:
        extra = row["name"] in ("deepspeed", "ray", "fp8", "ft")
        if row["status"] == "unavailable" and (row["kind"] == "tracker" or extra):
            # its library is not in this venv (DeepSpeed's, Ray's, fp8's and ft's plugins are installed without
            # their dependencies)
            assert f"pip install 'torchrig[{row['name']}]'" in row["reason"], row
            continue
        if row["status"] == "unavailable" and row["kind"] == "device":
            # installed, but its hardware is absent here (the plugin says why: no CUDA build/device, not macOS)
            assert row["name"] in ("cuda", "mps") and row["reason"], row
            continue
        assert row["status"] in ("selected", "available"), row
    trackers = {r["name"]: r["status"] for r in listing if r["kind"] == "tracker"}
    assert trackers == {"csv": "available", "jsonl": "available", "tensorboard": "unavailable",
                        "wandb": "unavailable", "mlflow": "unavailable"}, trackers
    strategies = {r["name"]: r for r in listing if r["kind"] == "strategy"}
    for name, distribution in (("ddp", "torchrig-ddp"), ("fsdp", "torchrig-fsdp"), ("deepspeed", "torchrig-deepspeed")):
        assert strategies[name]["distribution"] == distribution and strategies[name]["version"] == version
    clusters = {r["name"]: r for r in listing if r["kind"] == "cluster"}
    assert {"torchelastic", "slurm", "mpi", "env", "process_group", "local"} <= set(clusters), sorted(clusters)
    assert (clusters["ray"]["distribution"], clusters["ray"]["version"]) == ("torchrig-ray", version), clusters["ray"]
    assert clusters["ray"]["status"] == "unavailable", clusters["ray"]  # no Ray in this venv

    installed = json.loads(sh(venv / "bin" / "torchrig", "env", "--json", env=env).stdout)["plugin_distributions"]
    for name in ["torchrig", "torchrig-ddp", "torchrig-fsdp", "torchrig-deepspeed", "torchrig-trackers", "torchrig-ray",
                 "torchrig-fp8", "torchrig-ft"]:
        assert installed.get(name) == version, installed
    imports = "import torchrig_ddp, torchrig_fsdp, torchrig_deepspeed, torchrig_trackers, torchrig_ray, torchrig_fp8, torchrig_ft, torchrig.testing.fakes, torchrig.testing.recorder"
    sh(python, "-c", imports, env=env)
