"""`torchrig new-plugin NAME KIND`: the rendered distributions work as a plugin author uses them.

One test walks the author's path for all five kinds at once, in a fresh virtual environment
that sees the packages of the environment running the tests (a ``.pth`` adds its site
directories: ``--system-site-packages`` would show the *base* interpreter's instead, which in a
virtual environment lacks torchrig and the build tools), so nothing is installed here: render,
``pip install -e``, ``torchrig plugins`` lists them, a config file selects each by name (validated,
then a real one-process run), and the generated contract tests pass — without touching torchrig's
source.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from torchrig.cli.main import main
from torchrig.cli.new_plugin import render
from torchrig.plugin.kinds import PluginKind

KINDS = [kind.value for kind in PluginKind]


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("kind", KINDS)
def test_rendered_package_declares_both_entry_points_and_a_contract_test(kind):
    files = render("acme", kind)
    project = tomllib.loads(files["pyproject.toml"])
    groups = project["project"]["entry-points"]
    runtime_group, manifest_group = PluginKind.parse(kind).runtime_group, PluginKind.parse(kind).manifest_group
    assert groups[runtime_group] == {"acme": f"torchrig_acme.runtime:Acme{kind.capitalize()}"}
    assert groups[manifest_group] == {"acme": f"torchrig_acme.manifest:Acme{kind.capitalize()}Manifest"}
    assert "-p torchrig.testing.pytest_plugin" in project["tool"]["pytest"]["ini_options"]["addopts"]
    test = files[f"tests/test_acme_{kind}.py"]
    assert f"from torchrig.testing.contracts import {kind.capitalize()}Contract" in test
    for path, text in files.items():
        if path.endswith(".py"):
            compile(text, path, "exec")
            assert "TODO" not in text and "\n    pass\n" not in text, path
            assert "torchrig.builtins" not in text and "torchrig.defaults" not in text, path  # public API only


@pytest.mark.parametrize(("args", "message"), [
    (["new-plugin", "Acme", "strategy"], "invalid plugin name 'Acme'"),
    (["new-plugin", "acme", "strategi"], "unknown plugin kind 'strategi'"),
    (["new-plugin", "acme"], "the following arguments are required: KIND"),
])
def test_usage_errors_exit_2_naming_the_problem(args, message):
    code, _, err = cli(*args)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_an_existing_directory_is_refused(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    code, _, err = cli("new-plugin", "acme", "tracker", "--dir", str(tmp_path / "taken"))
    assert code == 2 and "already exists" in err and "--dir" in err


RUN_SCRIPT = """
import json, sys, torch
from torchrig import Accelerator
accelerator = Accelerator(config_file=sys.argv[1], project_dir=sys.argv[2])
model = torch.nn.Linear(4, 2)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
accelerator.init_trackers("demo")
with accelerator.autocast():
    dtype = str(torch.nn.functional.linear(torch.randn(3, 4), torch.randn(2, 4)).dtype)
accelerator.log({"loss": 0.5}, step=0)
report = accelerator.end_training()
print(json.dumps({"strategy": accelerator.strategy, "precision": accelerator.mixed_precision, "dtype": dtype,
                  "owners": accelerator.step_plan.owners, "device": accelerator.device.type,
                  "tracker": report["acme_tracker"]["state"]}))
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(420)
def see_this_environment(python: str) -> None:
    """Let the virtual environment of ``python`` import what this environment has (after its own
    packages): ``site.addsitedir`` also runs the editable installs' ``.pth`` files."""
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True,
                         text=True, check=True, timeout=60).stdout.strip()
    ours = [path for path in site.getsitepackages() if os.path.isdir(path)]
    Path(own, "zz_test_environment.pth").write_text(
        "".join(f"import site; site.addsitedir({path!r})\n" for path in ours))


def test_rendered_plugins_install_list_select_and_pass_their_contracts(tmp_path, process_guard):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")

    def run(*command: str, cwd: Path = tmp_path, timeout: int = 300) -> str:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        process_guard.track(proc)
        out, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, f"{' '.join(command)} exited {proc.returncode}:\n{out[-6000:]}"
        return out

    for kind in KINDS:
        run(sys.executable, "-m", "torchrig", "new-plugin", f"acme_{kind}", kind, "--dir", f"acme-{kind}")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = str(venv / "bin" / "python")
    see_this_environment(python)
    run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
        *(arg for kind in KINDS for arg in ("-e", f"acme-{kind}")))

    listed = {(row["kind"], row["name"]): row for row in json.loads(run(python, "-m", "torchrig", "plugins", "--json"))["plugins"]}
    for kind in KINDS:
        row = listed[(kind, f"acme_{kind}")]
        assert (row["distribution"], row["version"], row["status"]) == (f"torchrig-acme-{kind}", "0.1.0", "available"), row

    config = tmp_path / "run.yaml"
    config.write_text("strategy: acme_strategy\nmixed_precision: acme_precision\ndevice: acme_device\n"
                      "cluster: acme_cluster\nlog_with: [acme_tracker]\nacme_precision_config:\n  dtype: bfloat16\n")
    assert "valid (strategy acme_strategy, mixed_precision acme_precision" in run(
        python, "-m", "torchrig", "config", "validate", str(config))
    result = json.loads(run(python, "-c", RUN_SCRIPT, str(config), str(tmp_path / "project")).splitlines()[-1])
    assert (result["strategy"], result["precision"], result["dtype"]) == ("acme_strategy", "acme_precision", "torch.bfloat16")
    assert result["owners"]["autocast"] == "precision:acme_precision" and result["tracker"] == "finished"
    assert (tmp_path / "project" / "demo" / "metrics.txt").read_text().split() == ["0", "loss", "0.5"]

    out = run(python, "-m", "pytest", "-q", "-p", "torchrig.testing.pytest_plugin", "-p", "no:cacheprovider",
              *(f"acme-{kind}/tests" for kind in KINDS))
    assert " failed" not in out and " passed" in out, out
    # Kept from the installed environment: the rendered plugins never reached it.
    assert "acme_strategy" not in subprocess.run([sys.executable, "-m", "torchrig", "plugins"], capture_output=True,
                                                 text=True, env=env, timeout=120).stdout
