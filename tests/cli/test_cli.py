"""The `torchrig` command as a user runs it: a real subprocess, its output and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torchrig


def run_cli(*args: str, env: dict[str, str] | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m torchrig ARGS` (or `python -c CODE`) and capture its output."""
    command = [sys.executable, "-c", code] if code else [sys.executable, "-m", "torchrig", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


NO_TORCH_CHECK = """
import sys, contextlib, io
from torchrig.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        code = main({args!r})
    except SystemExit as exc:
        code = exc.code
print("TORCH_IMPORTED" if "torch" in sys.modules else "TORCH_NOT_IMPORTED", code)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["plugins"], ["plugins", "--json"], []])
def test_cli_answers_without_importing_torch(args):
    result = run_cli(code=NO_TORCH_CHECK.format(args=args))
    assert result.returncode == 0, result.stderr
    assert "TORCH_NOT_IMPORTED 0" in result.stdout


@pytest.mark.multiprocess
def test_import_torchrig_does_not_import_torch():
    result = run_cli(code="import sys, torchrig; print(torchrig.__version__, 'torch' in sys.modules)")
    assert result.stdout.split() == [torchrig.__version__, "False"]


@pytest.mark.multiprocess
def test_version():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"torchrig {torchrig.__version__}"


@pytest.mark.multiprocess
def test_plugins_json_lists_core_builtins_with_distribution_and_version():
    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["plugins"]
    by_key = {(r["kind"], r["name"]): r for r in rows}
    for key in [("strategy", "single"), ("precision", "no"), ("precision", "fp16"), ("precision", "bf16"),
                ("device", "cpu"), ("device", "cuda"), ("device", "mps")]:
        row = by_key[key]
        assert row["distribution"] == "torchrig"
        assert row["version"] == torchrig.__version__
        assert row["status"] in ("selected", "available") or key[0] == "device"
    assert by_key[("strategy", "single")]["status"] == "selected"
    assert by_key[("precision", "no")]["status"] == "selected"
    assert by_key[("device", "cuda")]["summary"]


@pytest.mark.multiprocess
def test_plugins_lists_an_absent_device_as_unavailable_with_the_reason():
    """Issue 41: cuda and mps were "available" on a machine with neither."""
    import torch

    result = run_cli("plugins", "--json")
    assert result.returncode == 0, result.stderr
    by_name = {r["name"]: r for r in json.loads(result.stdout)["plugins"] if r["kind"] == "device"}
    assert by_name["cpu"]["status"] == "available"
    if not torch.cuda.is_available():
        assert by_name["cuda"]["status"] == "unavailable"
        assert by_name["cuda"]["reason"] in ("no CUDA device visible", f"torch {torch.__version__} is built without CUDA")
    if sys.platform != "darwin":
        assert by_name["mps"]["status"] == "unavailable"
        assert "macOS" in by_name["mps"]["reason"]
    table = run_cli("plugins", "--kind", "device")
    mps_line = next(line for line in table.stdout.splitlines() if line.split()[:2] == ["device", "mps"])
    assert "unavailable" in mps_line and "macOS" in mps_line


def _fake_torch(tmp_path, cuda, hip="None"):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "version.py").write_text(
        f"from typing import Optional\n__version__ = '9.9.9'\ncuda: Optional[str] = {cuda}\nhip = {hip}\n")
    (tmp_path / "dev").mkdir()
    return tmp_path / "torch", tmp_path / "dev"


def test_cuda_absence_is_read_from_the_torch_build_and_the_device_nodes(tmp_path):
    from torchrig.builtins.device_presence import cuda_absence

    torch_dir, dev = _fake_torch(tmp_path, cuda="'12.4'")
    assert cuda_absence(torch_dir=torch_dir, dev_dir=dev, environ={}) == "no CUDA device visible"
    (dev / "nvidia0").write_text("")
    assert cuda_absence(torch_dir=torch_dir, dev_dir=dev, environ={}) is None
    assert cuda_absence(torch_dir=torch_dir, dev_dir=dev, environ={"CUDA_VISIBLE_DEVICES": ""}) == (
        "no CUDA device visible (CUDA_VISIBLE_DEVICES='' hides every GPU)")
    (torch_dir / "version.py").write_text("__version__ = '9.9.9'\ncuda = None\nhip = None\n")
    assert cuda_absence(torch_dir=torch_dir, dev_dir=dev, environ={}) == "torch 9.9.9 is built without CUDA"


@pytest.mark.multiprocess
def test_plugins_table_and_disabled_status():
    result = run_cli("plugins", env={"TORCHRIG_DISABLE_PLUGINS": "precision:fp16"})
    assert result.returncode == 0, result.stderr
    lines = {tuple(line.split()[:2]): line for line in result.stdout.splitlines()[1:]}
    assert "disabled" in lines[("precision", "fp16")]
    assert lines[("strategy", "single")].split()[4] == "selected"


@pytest.mark.multiprocess
def test_plugins_kind_filter_and_bad_kind():
    ok = run_cli("plugins", "--kind", "precision", "--json")
    assert {r["kind"] for r in json.loads(ok.stdout)["plugins"]} == {"precision"}
    bad = run_cli("plugins", "--kind", "strategi")
    assert bad.returncode == 2
    assert "unknown plugin kind 'strategi'" in bad.stderr
    assert "Traceback" not in bad.stderr


@pytest.mark.multiprocess
@pytest.mark.parametrize("args", [["bogus"], ["plugins", "--bogus-flag"], ["env", "--nope"]])
def test_usage_errors_exit_2_without_traceback(args):
    result = run_cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "error" in result.stderr


@pytest.mark.multiprocess
def test_env_reports_versions_and_devices():
    result = run_cli("env", "--json", env={"TORCHRIG_DISABLE_PLUGINS": "x"})
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    import torch

    assert info["torchrig"] == torchrig.__version__
    assert info["torch"] == torch.__version__
    assert info["python"] == sys.version.split()[0]
    assert info["plugin_distributions"]["torchrig"] == torchrig.__version__
    assert {"torchrig-ddp", "torchrig-fsdp", "torchrig-deepspeed", "torchrig-trackers"} <= set(info["plugin_distributions"])
    assert info["cuda_available"] == torch.cuda.is_available()
    assert info["environment"]["TORCHRIG_DISABLE_PLUGINS"] == "x"
    text = run_cli("env")
    assert text.returncode == 0 and "torch:" in text.stdout


ENV_CHECK = """
import contextlib, io, json, sys
from torchrig.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(["env", "--json"])
print(json.dumps({"code": code, "torch_imported": "torch" in sys.modules, "info": json.loads(out.getvalue())}))
"""


@pytest.mark.multiprocess
def test_env_shows_what_accelerate_env_shows_without_importing_torch(tmp_path):
    """Issue 41: `torchrig env` lacked the default config, RAM and library versions, and took 12 s (it
    imported torch and its distributed backends to print versions)."""
    import importlib.metadata as md

    accelerate_file = tmp_path / "hf" / "accelerate" / "default_config.yaml"
    accelerate_file.parent.mkdir(parents=True)
    accelerate_file.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    torchrig_file = tmp_path / "torchrig" / "default_config.yaml"
    torchrig_file.parent.mkdir()
    torchrig_file.write_text("mixed_precision: bf16\n")
    env = {"HF_HOME": str(tmp_path / "hf"), "TORCHRIG_CONFIG_HOME": str(tmp_path / "torchrig")}
    result = run_cli(code=ENV_CHECK, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["code"] == 0 and report["torch_imported"] is False
    info = report["info"]
    assert info["torch"] == md.version("torch")
    for name in ("numpy", "torchao", "tensorboard", "wandb", "mlflow", "transformers", "deepspeed", "accelerate"):
        try:
            expected = md.version(name)
        except md.PackageNotFoundError:
            expected = None
        assert info["libraries"][name] == expected, name
    with open("/proc/meminfo") as meminfo:
        total_kb = int(next(line for line in meminfo if line.startswith("MemTotal")).split()[1])
    assert info["ram_gb"] == round(total_kb / 1024**2, 2)
    assert info["default_config"] == {"path": str(torchrig_file), "contents": {"mixed_precision": "bf16"}}
    assert info["accelerate_default_config"] == {"path": str(accelerate_file),
                                                 "contents": {"distributed_type": "MULTI_GPU", "num_processes": 2}}
    assert info["devices"]["cpu"] == "available"
    assert info["torchrig_location"]
    text = run_cli("env", "--config_file", str(accelerate_file), env=env)
    assert f"default_config: {torchrig_file}" in text.stdout and "  mixed_precision: bf16" in text.stdout
    assert f"config_file: {accelerate_file}" in text.stdout and "  distributed_type: MULTI_GPU" in text.stdout


@pytest.mark.multiprocess
def test_console_script_is_installed():
    import shutil

    exe = shutil.which("torchrig")
    assert exe, "the `torchrig` console script is not on PATH"
    result = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == f"torchrig {torchrig.__version__}"
