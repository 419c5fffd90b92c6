"""`torchrig config` as a user runs it: questionnaire, --default, show, validate."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml


def cli(*args, env=None, stdin=None, cwd=None):
    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    return subprocess.run([sys.executable, "-m", "torchrig", *args], capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})}, input=stdin, cwd=cwd)


@pytest.fixture
def home(tmp_path):
    """An isolated TORCHRIG_CONFIG_HOME, so the machine's real default file is never touched."""
    return {"TORCHRIG_CONFIG_HOME": str(tmp_path / "home")}


@pytest.mark.multiprocess
def test_questionnaire_writes_a_valid_default_file(tmp_path, home):
    answers = "single\nyes\nbf16\n4\n"
    result = cli("config", env=home, stdin=answers)
    assert result.returncode == 0, result.stderr
    written = yaml.safe_load((tmp_path / "home" / "default_config.yaml").read_text())
    assert written == {"strategy": "single", "use_cpu": True, "mixed_precision": "bf16", "gradient_accumulation_steps": 4}


@pytest.mark.multiprocess
def test_questionnaire_reasks_invalid_answers(tmp_path, home):
    answers = "warp-drive\nsingle\nmaybe\nno\nfp64\nfp16\n0\n\n"
    result = cli("config", env=home, stdin=answers)
    assert result.returncode == 0, result.stderr
    assert "choose one of" in result.stdout and "answer yes or no" in result.stdout
    written = yaml.safe_load((tmp_path / "home" / "default_config.yaml").read_text())
    assert written["mixed_precision"] == "fp16" and written["gradient_accumulation_steps"] == 1


@pytest.mark.multiprocess
def test_questionnaire_end_of_input_is_an_error_not_a_traceback(home):
    result = cli("config", env=home, stdin="single\n")
    assert result.returncode == 2
    assert "end of input" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.multiprocess
def test_default_writes_detected_hardware(tmp_path, home):
    result = cli("config", "--default", env=home)
    assert result.returncode == 0, result.stderr
    written = yaml.safe_load((tmp_path / "home" / "default_config.yaml").read_text())
    import torch

    assert written["use_cpu"] is (not torch.cuda.is_available())
    assert written["mixed_precision"] == "no"


@pytest.mark.multiprocess
def test_show_explains_every_source(tmp_path, home):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "default_config.yaml").write_text("gradient_accumulation_steps: 2\nmixed_precision: 'no'\n")
    run = tmp_path / "run.yaml"
    run.write_text("mixed_precision: fp16\ndataloader_config:\n  split_batches: true\n")
    env = {**home, "TORCHRIG_USE_CPU": "true"}
    result = cli("config", "show", "--config_file", str(run), "--mixed_precision", "bf16", "--json", env=env)
    assert result.returncode == 0, result.stderr
    values = json.loads(result.stdout)["values"]
    assert values["mixed_precision"] == {"value": "bf16", "source": "flag --mixed_precision"}
    assert values["gradient_accumulation_steps"]["source"].endswith("default_config.yaml:1:1")
    assert values["dataloader_config.split_batches"]["source"].endswith("run.yaml:3:3")
    assert values["use_cpu"] == {"value": True, "source": "environment TORCHRIG_USE_CPU"}
    assert values["num_machines"]["source"] == "default"
    table = cli("config", "show", "--config_file", str(run), "--only-set", env=env)
    assert table.returncode == 0
    assert "mixed_precision" in table.stdout and "run.yaml:1:1" in table.stdout
    assert "num_machines" not in table.stdout


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("mixed_precison: bf16\n", "did you mean 'mixed_precision'"),
        ("mixed_precision: fp32\n", "no precision plugin named 'fp32'"),
        ("num_processes: two\n", "expected an integer"),
        ("num_processes: [1,\n", "broken.yaml:"),
    ],
)
def test_validate_fails_with_exit_2_and_no_traceback(tmp_path, home, text, needle):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    result = cli("config", "validate", str(path), env=home)
    assert result.returncode == 2, result.stdout
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.multiprocess
def test_validate_accepts_a_good_file_and_reports_no_effect_keys(tmp_path, home):
    path = tmp_path / "ok.yaml"
    path.write_text("mixed_precision: bf16\ndowncast_bf16: 'no'\n")
    result = cli("config", "validate", str(path), env=home)
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout and "downcast_bf16" in result.stdout and "only affects TPUs" in result.stdout


@pytest.mark.multiprocess
def test_bad_flag_value_and_unknown_flag(tmp_path, home):
    bad = cli("config", "show", "--gradient_accumulation_steps", "lots", env=home)
    assert bad.returncode == 2 and "expected an integer" in bad.stderr and "Traceback" not in bad.stderr
    unknown = cli("config", "show", "--mixed_precison", "bf16", env=home)
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr


@pytest.mark.multiprocess
def test_validate_missing_file(tmp_path, home):
    result = cli("config", "validate", str(tmp_path / "missing.yaml"), env=home)
    assert result.returncode == 2 and "missing.yaml" in result.stderr


# -- Accelerate's habits (issue 41, item 5) -------------------------------------------------------


@pytest.fixture
def homes(tmp_path, monkeypatch):
    """TORCHRIG_CONFIG_HOME and HF_HOME in tmp_path (both empty), for in-process calls."""
    for name in [n for n in os.environ if n.startswith(("TORCHRIG_", "XDG_CACHE_HOME"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path / "torchrig-home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return tmp_path / "torchrig-home", tmp_path / "hf-home" / "accelerate"


def _write_accelerate_default(directory):
    directory.mkdir(parents=True)
    path = directory / "default_config.yaml"
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: bf16\n"
                    "num_processes: 1\nuse_cpu: true\ndowncast_bf16: 'no'\n")
    return path


def test_accelerates_default_config_is_read_when_torchrig_has_none(homes, tmp_path, capsys):
    from torchrig.config.resolve import accelerate_default_config_path, resolve_config
    from torchrig.launch.cli import run_launch
    from torchrig.testing.hosts import make_host

    torchrig_home, accelerate_home = homes
    path = _write_accelerate_default(accelerate_home)
    assert accelerate_default_config_path() == path
    assert accelerate_default_config_path({"XDG_CACHE_HOME": "/x"}) == __import__("pathlib").Path(
        "/x/huggingface/accelerate/default_config.yaml")
    host = make_host()
    config = resolve_config(host, warn=False)
    assert config["mixed_precision"] == "bf16"
    assert str(config.source("mixed_precision")) == f"accelerate default config {path}:3:1"
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    assert run_launch(["--dry-run", str(script)]) == 0
    captured = capsys.readouterr()
    assert f"accelerate default config {path}:3" in captured.out
    assert f"reading Accelerate's default config {path}" in captured.err  # said, with how to make torchrig's own
    # torchrig's own default file wins: Accelerate's is then not read at all
    torchrig_home.mkdir()
    (torchrig_home / "default_config.yaml").write_text("mixed_precision: fp16\n")
    assert resolve_config(host, warn=False)["mixed_precision"] == "fp16"


def test_config_default_is_accelerates_spelling_and_refuses_to_overwrite(homes):
    import io

    from torchrig.cli.config import run_config
    from torchrig.errors import ConfigError

    torchrig_home, _ = homes
    out = io.StringIO()
    assert run_config(["default", "--mixed_precision", "bf16"], stdout=out) == 0
    target = torchrig_home / "default_config.yaml"
    assert yaml.safe_load(target.read_text())["mixed_precision"] == "bf16"
    target.write_text("mixed_precision: fp16\n")
    for argv in (["default"], ["--default"]):
        with pytest.raises(ConfigError, match="already exists.*--force"):
            run_config(argv, stdout=out)
        assert target.read_text() == "mixed_precision: fp16\n"
    assert run_config(["default", "--force"], stdout=out) == 0
    assert yaml.safe_load(target.read_text())["mixed_precision"] == "no"


def test_questionnaire_shows_yes_no_defaults_as_words(homes):
    import io

    from torchrig.cli.config import run_config

    out = io.StringIO()
    assert run_config([], stdin=io.StringIO("single\n\n\n\n"), stdout=out) == 0
    assert "(yes/no) [False]" not in out.getvalue()
    assert "Run on the CPU only [yes/NO]: " in out.getvalue()


@pytest.mark.multiprocess
def test_ctrl_c_in_the_questionnaire_exits_130_without_a_traceback(tmp_path, home):
    import signal

    base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    proc = subprocess.Popen([sys.executable, "-m", "torchrig", "config"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**base, **home},
                            start_new_session=True)
    try:
        assert proc.stdout.read(len("Strategy")) == "Strategy"  # the first question is asked: waiting for input
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    assert not (tmp_path / "home" / "default_config.yaml").exists()
