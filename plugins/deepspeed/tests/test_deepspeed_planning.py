"""``torchrig plan`` with the deepspeed strategy: refused by the planning contract (``PlanningUnsupported``,
raised before DeepSpeed is imported or the model touched), reported on the rank, never as the run's error."""

from __future__ import annotations

import sys

import yaml
from torchrig.estimate.plan import PlanInputs, PlanTarget, plan_run
from torchrig.testing import hf_models


def test_a_planned_deepspeed_run_is_unsupported_by_name_and_never_imports_deepspeed(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what the strategy sets on a CPU; restored after the test
    imported_before = "deepspeed" in sys.modules
    hf_models.config("llama", num_hidden_layers=1).to_json_file(str(tmp_path / "config.json"))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"distributed_type": "DEEPSPEED",
                                                       "deepspeed_config": {"zero_stage": 3}}))
    report = plan_run(PlanInputs(model=str(tmp_path), seq_len=8,
                                 environment={"TORCHRIG_CONFIG_FILE": str(tmp_path / "run.yaml")}), PlanTarget(1, 8))
    (plan,) = report.ranks
    assert plan.error is None and report.errors == []
    assert plan.unsupported is not None
    assert "strategy 'deepspeed'" in plan.unsupported and "deepspeed.initialize" in plan.unsupported
    assert "ZeRO-3" in plan.unsupported
    if not imported_before:  # another test of this process may have imported it already
        assert "deepspeed" not in sys.modules
