"""DeepSpeed's memory estimate reads its typed section and the DeepSpeed JSON as the engine is
built from them: the stage comes from ``zero_stage``, else the JSON's ``zero_optimization.stage``
(a file or an inline mapping), else Accelerate's default 2."""

from __future__ import annotations

import json

import torch
from torchrig.cli.estimate import estimate_memory
from torchrig.estimate.memory import MemoryRequest
from torchrig.estimate.memory_model import build_on_meta, footprint
from torchrig.host.plugin_host import PluginHost
from torchrig.testing import resolved_config


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))


def _label(**config):
    model = footprint(build_on_meta(_mlp, "mlp"), "mlp", batch_size=2, seq_len=4)
    request = MemoryRequest(model=model, world_size=2, strategy="deepspeed", config=resolved_config(config))
    return estimate_memory(PluginHost(), request).label


def test_the_stage_comes_from_zero_stage_then_the_json_then_the_default(tmp_path):
    ds_file = tmp_path / "ds.json"
    ds_file.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    assert _label() == "deepspeed ZeRO-2"
    assert _label(**{"deepspeed_config.hf_ds_config": str(ds_file)}) == "deepspeed ZeRO-3"
    assert _label(**{"deepspeed_config.hf_ds_config": {"zero_optimization": {"stage": 1}}}) == "deepspeed ZeRO-1"
    assert _label(**{"deepspeed_config.hf_ds_config": {"zero_optimization": {"stage": "auto"}},
                     "deepspeed_config.zero_stage": 0}) == "deepspeed ZeRO-0"
