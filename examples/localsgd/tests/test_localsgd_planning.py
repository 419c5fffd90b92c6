"""``torchrig plan`` with the localsgd strategy: refused by the planning contract (``PlanningUnsupported``
before the model is moved or broadcast), reported on the rank with the reason, never as the run's error."""

from __future__ import annotations

import yaml
from torchrig.estimate.plan import PlanInputs, PlanTarget, plan_run
from torchrig.testing import hf_models


def test_a_planned_localsgd_run_is_unsupported_by_name(tmp_path):
    hf_models.config("llama", num_hidden_layers=1).to_json_file(str(tmp_path / "config.json"))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"strategy": "localsgd", "localsgd_config": {"sync_every": 4}}))
    report = plan_run(PlanInputs(model=str(tmp_path), seq_len=8,
                                 environment={"TORCHRIG_CONFIG_FILE": str(tmp_path / "run.yaml")}), PlanTarget(1, 8))
    (plan,) = report.ranks
    assert plan.error is None and report.errors == []
    assert plan.unsupported is not None and plan.unsupported.startswith("strategy 'localsgd'")
    assert "sync_every" in plan.unsupported
