"""Every flag of Accelerate's ``accelerate launch`` is accepted by ``torchrig launch`` (issue 41, item 4):
applied where torchrig has the meaning, accepted with the config table's "no effect" note, or refused
with the reason — never "unrecognized flag". Plugin-owned flags without their plugin give the install
hint ``--strategy`` gives.

The list is ``tests/compat/data/accelerate_launch_flags.json``, generated from Accelerate 1.15's own parser by
``tests/compat/data/gen_accelerate_launch_flags.py``: a flag a new Accelerate adds fails here until the table
``torchrig.config.compat.ACCELERATE_LAUNCH_FLAGS`` (or a torchrig flag) says what it does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torchrig.config import compat
from torchrig.errors import ConfigError, TorchrigError
from torchrig.host.discovery import installed_distributions
from torchrig.launch.cli import build_parser, run_launch, split_argv
from torchrig.testing.hosts import make_host

SNAPSHOT = json.loads((Path(__file__).parent / "data" / "accelerate_launch_flags.json").read_text())
LAUNCH_TIMEOUT = 120


def _core_only_host(*keep: str):
    """A host over the core's distribution (plus ``keep``): the first-party plugins not installed."""
    names = {"torchrig", *keep}
    return make_host(*[d for d in installed_distributions() if d.metadata["Name"] in names], include_installed=False)


@pytest.fixture
def script(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path / "config-home"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for name in [n for n in os.environ if n.startswith("TORCHRIG_") and n != "TORCHRIG_CONFIG_HOME"]:
        monkeypatch.delenv(name)
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return str(path)


def _tokens(flag: dict, spelling: str) -> list[str]:
    return [spelling, "1"] if flag["takes_value"] else [spelling]


@pytest.mark.parametrize("plugins", ["installed", "core only"])
def test_every_accelerate_launch_flag_in_every_spelling_is_accepted(plugins):
    host = make_host() if plugins == "installed" else _core_only_host()
    parser, _ = build_parser(host)
    assert SNAPSHOT["source"].startswith("accelerate 1.15")
    unrecognized = []
    for flag in SNAPSHOT["flags"]:
        for spelling in flag["spellings"]:
            try:
                tokens, command = split_argv(parser, [*_tokens(flag, spelling), "train.py"])
                parser.parse_args(tokens)
            except (ConfigError, SystemExit) as exc:
                unrecognized.append(f"{spelling}: {exc}")
                continue
            assert command == ["train.py"], spelling
    assert unrecognized == []


def test_every_accelerate_flag_torchrig_has_no_flag_for_is_in_the_table():
    parser, _ = build_parser(_core_only_host())
    core = {o for action in parser._actions for o in action.option_strings}
    declared = {entry.flag for entry in compat.ACCELERATE_LAUNCH_FLAGS}
    missing = [f["spellings"][0] for f in SNAPSHOT["flags"]
               if not (set(f["spellings"]) & core) and f["spellings"][0] not in declared]
    assert missing == []
    assert declared - {f["spellings"][0] for f in SNAPSHOT["flags"]} == set()  # nothing invented


@pytest.mark.parametrize("argv, hint", [
    (["--use_deepspeed"], "pip install 'torchrig[deepspeed]'"),
    (["--zero_stage", "2"], "pip install 'torchrig[deepspeed]'"),
    (["--use-fsdp"], "pip install 'torchrig[fsdp]'"),
    (["--fsdp_sharding_strategy", "FULL_SHARD"], "pip install 'torchrig[fsdp]'"),
    (["--fp8_backend", "AO"], "pip install 'torchrig[fp8]'"),
])
def test_plugin_flags_without_the_plugin_give_the_install_hint(script, argv, hint):
    host = _core_only_host("torchrig-ddp")
    with pytest.raises(ConfigError) as caught:
        run_launch([*argv, "--dry-run", script], host=host)
    assert hint in str(caught.value)
    assert "unrecognized" not in str(caught.value)


def test_a_disabled_plugins_flags_say_it_is_disabled_as_strategy_does(script):
    host = make_host(disabled=["strategy:deepspeed"])
    for argv in (["--strategy", "deepspeed"], ["--zero_stage", "2"], ["--use_deepspeed"]):
        with pytest.raises(TorchrigError, match="disabled"):
            run_launch([*argv, "--dry-run", script], host=host)


def test_no_effect_flags_print_the_config_tables_note_and_refusals_name_the_reason(script, capsys):
    out = []
    code = run_launch(["--same_network", "--downcast-bf16", "--main_training_function", "main", "--debug", "-q",
                       "--role", "trainer", "--enable_cpu_affinity", "--no_tpu_cluster", "--dry-run", script])
    assert code == 0
    err = capsys.readouterr().err
    for key in ("same_network", "downcast_bf16", "main_training_function", "debug", "enable_cpu_affinity"):
        assert compat.BY_KEY[key].note in err, key
    assert "--quiet has no effect" in err and "--role has no effect" in err
    for argv, reason in ((["--tpu"], "TPUs are not supported"), (["--use_megatron_lm"], "Megatron-LM is not supported"),
                         (["--megatron_lm_tp_degree", "2"], "Megatron-LM is not supported"),
                         (["--aws_access_key_id", "x"], "SageMaker"),
                         (["--deepspeed_hostfile", "hosts"], "--num_machines"),
                         (["--parallelism_config_sp_size", "2"], "sequence parallelism")):
        with pytest.raises(ConfigError) as caught:
            run_launch([*argv, "--dry-run", script])
        out.append(str(caught.value))
        assert reason in str(caught.value), argv
        assert argv[0] in str(caught.value)


def test_applied_flags_reach_the_configuration_and_the_ranks_environment(script, capsys):
    code = run_launch(["--multi_gpu", "--num-processes", "2", "--num_cpu_threads_per_process", "3",
                       "--parallelism_config_dp_replicate_size", "2", "--rdzv_conf", "join_timeout=5",
                       "--dry-run", script])
    assert code == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert any(line.split()[:4] == ["strategy", "ddp", "flag", "--multi_gpu"] for line in lines), captured.out
    assert any(line.split()[:2] == ["parallelism_config.dp_replicate_size", "2"] for line in lines), captured.out
    assert sum("OMP_NUM_THREADS=3" in line for line in lines) == 2, captured.out
    # one machine: no rendezvous round, so --rdzv_conf is said to do nothing rather than dropped
    assert "--rdzv_conf has no effect" in captured.err
    with pytest.raises(ConfigError, match="--rdzv_conf"):
        run_launch(["--rdzv_conf", "join_timeout", "--dry-run", script])
    # Accelerate's habit `--multi_gpu --use_fsdp` is FSDP: --multi_gpu gives way to a flag naming the strategy
    for argv in (["--multi_gpu", "--use_fsdp"], ["--use_fsdp", "--multi_gpu"], ["--multi_gpu", "--strategy", "ddp"]):
        capsys.readouterr()
        assert run_launch([*argv, "--num_processes", "2", "--dry-run", script]) == 0
        strategy_line = next(line for line in capsys.readouterr().out.splitlines() if line.split()[:1] == ["strategy"])
        assert strategy_line.split()[1] == ("ddp" if "ddp" in argv else "fsdp"), argv


@pytest.mark.multiprocess
def test_num_cpu_threads_per_process_sets_the_ranks_threads(tmp_path, process_guard):
    """The effect, in a real rank: OMP_NUM_THREADS and torch's intra-op threads (Accelerate overrides the
    launcher's own OMP_NUM_THREADS with the flag, so does torchrig). One rank: the flag is per process."""
    script = tmp_path / "threads.py"
    script.write_text("import os, torch\n"
                      "print('THREADS', os.environ['OMP_NUM_THREADS'], torch.get_num_threads(), flush=True)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), HF_HOME=str(tmp_path / "hf"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torchrig", "launch", "--num_processes", "1",
                             "--num-cpu-threads-per-process", "2", "--log_dir", str(tmp_path / "logs"), "--tee", "0",
                             str(script)], start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)
    process_guard.track(proc)
    out, err = proc.communicate(timeout=LAUNCH_TIMEOUT)
    assert proc.returncode == 0, err
    assert [line.split()[1:] for line in out.splitlines() if line.startswith("THREADS")] == [["2", "2"]], out
