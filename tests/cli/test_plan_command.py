"""``torchrig plan``: the command line over the plan engine — the launch's configuration flags and file, the
target, the report and its exit codes (0 plans cleanly, 1 the run would fail, 2 a usage problem)."""

from __future__ import annotations

import json

import pytest
import yaml
from torchrig.cli.main import main
from torchrig.testing import hf_models


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    hf_models.config("llama").to_json_file(str(folder / "config.json"))
    return str(folder)


def _config(tmp_path, **parallelism):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "FSDP", "parallelism_config": parallelism}))
    return str(path)


def test_a_plan_prints_each_ranks_memory_collectives_and_step_time(model, tmp_path, capsys):
    config = _config(tmp_path, dp_shard_size=8, tp_size=2)
    code = main(["plan", model, "--num_machines", "2", "--num_processes", "16", "--config_file", config,
                 "--seq_len", "8", "--gpu", "a100-80gb"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "on 2 machine(s) × 8 = 16 ranks; a100-80gb, ib-ndr-400" in out
    assert "rank 0 (every rank alike; dp_shard 8 × tp 2; strategy fsdp" in out
    assert "memory at the peak" in out and "left on a a100-80gb" in out
    # dp_shard's groups span both machines (ranks 0, 2, .. 14), tp's pairs stay on one
    links = {tuple(line.split()[:2]): line.rstrip() for line in out.splitlines() if line.startswith("  dp_shard ")
             or line.startswith("  tp ")}
    assert links[("dp_shard", "all_gather")].endswith("between machines")
    assert all(line.endswith("within a machine") for (axis, _), line in links.items() if axis == "tp")
    assert "step time on a100-80gb" in out and "tokens/s per GPU" in out
    assert "assumptions of the step time:" in out and out.rstrip().endswith("and fits")


def test_json_gives_the_same_report_as_data(model, tmp_path, capsys):
    config = _config(tmp_path, dp_shard_size=4)
    assert main(["plan", model, "--num_processes", "4", "--config_file", config, "--seq_len", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (rank,) = report["ranks"]
    assert report["target"]["world_size"] == 4 and report["target"]["gpu"]["name"] == "h100-sxm"
    assert rank["layout"]["mesh"] == {"dp_shard": 4} and rank["error"] is None
    assert rank["memory"]["fits"] is True and rank["memory"]["peak_bytes"] > 0
    kinds = {(c["axis"], c["kind"]) for c in rank["collectives"]}
    assert {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter")} <= kinds
    assert rank["step_time"]["total_s"] > 0 and report["errors"] == []


def test_a_run_that_would_fail_exits_1_naming_the_key(model, tmp_path, capsys):
    config = _config(tmp_path, dp_shard_size=2, tp_size=4)  # 2 key/value heads over tp 4
    assert main(["plan", model, "--num_processes", "8", "--config_file", config, "--seq_len", "8"]) == 1
    out = capsys.readouterr().out
    assert "rank 0: FAILS at accelerator.prepare(model, optimizer): ConfigError" in out
    assert "parallelism_config.tp_size" in out and "1 error(s): the run would fail" in out


def test_a_step_that_does_not_fit_the_gpu_exits_1(tmp_path, capsys):
    folder = tmp_path / "wide"
    folder.mkdir()
    hf_models.config("llama", hidden_size=1024, intermediate_size=4096, num_attention_heads=8,
                     vocab_size=32000).to_json_file(str(folder / "config.json"))
    code = main(["plan", str(folder), "--num_processes", "8", "--config_file", _config(tmp_path, dp_shard_size=8),
                 "--seq_len", "16384", "--batch_size", "8", "--gpu", "l4"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "DOES NOT FIT" in out and "a l4 has 24.00 GiB" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["--gpu", "h900"], "h900"),
    (["--interconnect", "carrier-pigeon"], "carrier-pigeon"),
    (["--ranks", "a,b"], "'a,b' is not a comma-separated list of ranks"),
    (["--num_machines", "3", "--num_processes", "8"], "num_processes 8"),
])
def test_usage_errors_exit_2_with_one_line(model, argv, message, capsys):
    assert main(["plan", model, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.startswith("torchrig plan: error:")


def test_gpu_list_names_the_known_kinds(capsys):
    assert main(["plan", "anything", "--gpu", "list"]) == 0
    names = capsys.readouterr().out.split()
    assert {"h100-sxm", "a100-80gb", "mi300x"} <= set(names)
