"""``torchrig plan train.py`` and ``torchrig launch --plan-only``: a user's script runs up to its
``accelerator.prepare`` in each planned rank's fake world, and what it prepared — its Accelerator's
arguments, its model, its optimizer — is what is planned; its errors name the script's line."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import yaml
from torchrig.cli.main import main
from torchrig.testing import hf_models

SCRIPT = textwrap.dedent('''\
    """A user's script: a transformers Llama from a config, AdamW, a data loader, the usual loop."""
    import argparse

    import torch
    import transformers
    from torch.utils.data import DataLoader

    from torchrig import Accelerator
    from torchrig.testing import hf_models

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--with_optimizer", type=int, default=1)
    args = parser.parse_args()
    accelerator = Accelerator(mixed_precision="bf16")
    model = transformers.AutoModelForCausalLM.from_config(hf_models.config("llama", num_hidden_layers=args.layers))
    loader = DataLoader(hf_models.make_data(64), batch_size=2)
    if args.with_optimizer:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        loader, model = accelerator.prepare(loader, model)
    raise SystemExit("the training loop ran: the plan must stop at prepare")
    ''')
PREPARE_LINE = 20  # the prepare with the optimizer


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def _config(tmp_path, **parallelism):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"distributed_type": "FSDP", "parallelism_config": parallelism}))
    return str(path)


def _parameters(layers: int) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in hf_models.build("llama", num_hidden_layers=layers).parameters())


def test_launch_plan_only_plans_what_the_script_prepares(script, tmp_path, capsys):
    config = _config(tmp_path, dp_shard_size=4, tp_size=2)
    code = main(["launch", "--plan-only", "--config_file", config, "--num_processes", "8", "--seq_len", "8",
                 "--json", str(script), "--layers", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads(out)
    (rank,) = report["ranks"]
    assert rank["error"] is None and report["errors"] == []
    layout = rank["layout"]
    # the script's model (its --layers 3 reached it), its Accelerator's bf16, the config file's mesh
    assert layout["total_parameters"] == _parameters(3) != _parameters(2)
    assert layout["mixed_precision"] == "bf16" and layout["mesh"] == {"dp_shard": 4, "tp": 2}
    assert layout["local_parameters"] < layout["total_parameters"]
    # the script's SGD has no state: the plan counts the optimizer the script prepared, not its own AdamW
    assert rank["memory"]["by_category"]["optimizer_state"] == 0
    assert {(c["axis"], c["kind"]) for c in rank["collectives"]} >= {("dp_shard", "all_gather"), ("tp", "all_reduce")}


def test_plan_takes_a_script_with_its_arguments_and_stands_in_for_an_optimizer_it_lacks(script, tmp_path, capsys):
    config = _config(tmp_path, dp_shard_size=4)
    code = main(["plan", "--config_file", config, "--num_processes", "4", "--seq_len", "8", "--json",
                 str(script), "--with_optimizer", "0"])
    out = capsys.readouterr().out
    assert code == 0, out
    (rank,) = json.loads(out)["ranks"]
    assert rank["layout"]["total_parameters"] == _parameters(2)
    assert rank["memory"]["by_category"]["optimizer_state"] > 0  # the plan's AdamW, prepared by the script's Accelerator


def test_an_error_at_prepare_names_the_scripts_line(script, tmp_path, capsys):
    config = _config(tmp_path, dp_shard_size=2, tp_size=4)  # 2 key/value heads over tp 4
    code = main(["launch", "--plan-only", "--config_file", config, "--num_processes", "8", "--seq_len", "8",
                 str(script)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert f"rank 0: train.py:{PREPARE_LINE}: " in out and "num_key_value_heads is 2, not divisible by tp_size 4" in out, out


def test_a_script_that_never_prepares_a_model_is_reported(tmp_path, capsys):
    script = tmp_path / "nothing.py"
    script.write_text("from torchrig import Accelerator\naccelerator = Accelerator()\n")
    code = main(["launch", "--plan-only", "--num_processes", "2", str(script)])
    out = capsys.readouterr().out
    assert code == 1 and "ended without calling accelerator.prepare on a model" in out, out
    broken = tmp_path / "broken.py"
    broken.write_text("import sys\n\nraise KeyError('no_such_column')\n")
    assert main(["plan", "--num_processes", "2", str(broken)]) == 1
    assert "broken.py:3: KeyError: 'no_such_column'" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--gpu", "a100-80gb", "train.py"], "--gpu only applies with --plan-only"),
    (["--plan-only", "--dry-run", "train.py"], "--plan-only and --dry-run exclude each other"),
    (["--plan-only", "--no_python", "train.py"], "--no_python command cannot be run up to its accelerator.prepare"),
    (["--plan-only", "--seq_len", "0", "train.py"], "0 must be at least 1"),
    (["--plan-only"], "no script to launch"),
])
def test_plan_flags_and_plan_only_refuse_what_does_not_fit(argv, message, capsys):
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err
