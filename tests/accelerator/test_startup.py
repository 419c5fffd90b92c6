"""What ``python train.py`` pays before its first step (benchmark B12): modules a run that does
not need them must not import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

FIRST_STEP = """
import json, sys
import torch
from torchrig import Accelerator
accelerator = Accelerator()
print(json.dumps(sorted(sys.modules)))
"""


def modules_after(code: str, tmp_path, **env: str) -> set[str]:
    """The modules a fresh interpreter holds after ``code`` (which prints them as JSON)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    environ.update({"TORCHRIG_CONFIG_HOME": str(tmp_path), "OMP_NUM_THREADS": "1", **env})
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environ,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


@pytest.mark.multiprocess
def test_a_run_reading_no_config_file_does_not_import_yaml(tmp_path):
    assert "yaml" not in modules_after(FIRST_STEP, tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text("gradient_accumulation_steps: 2\n")
    assert "yaml" in modules_after(FIRST_STEP, tmp_path, TORCHRIG_CONFIG_FILE=str(config))


PLUGIN_OPTIONS = {"torchrig_ddp.options", "torchrig_fsdp.options", "torchrig_deepspeed.options", "torchrig_fp8.options",
                  "torchrig_localsgd.options"}


@pytest.mark.multiprocess
def test_a_run_imports_the_options_of_no_plugin_it_does_not_use(tmp_path):
    """Every installed plugin's manifest is read, but its options class (declared by reference)
    is imported only when the run uses its section; DeepSpeed's configuration checks (a 600-line
    module) only when the deepspeed strategy validates a configuration."""
    modules = modules_after(FIRST_STEP, tmp_path)
    assert {"torchrig_fsdp.manifest", "torchrig_deepspeed.manifest"} <= modules
    assert not PLUGIN_OPTIONS & modules
    touched = modules_after(FIRST_STEP, tmp_path, TORCHRIG_DEEPSPEED_CONFIG__ZERO_STAGE="2")
    assert PLUGIN_OPTIONS & touched == {"torchrig_deepspeed.options"}
    assert "torchrig_deepspeed.config_checks" not in touched


@pytest.mark.multiprocess
def test_the_checkpoint_machinery_is_imported_by_the_first_checkpoint_call(tmp_path):
    modules = modules_after(FIRST_STEP, tmp_path)
    assert not {"torchrig.checkpoint.manager", "torchrig.checkpoint.export", "safetensors"} & modules
    saved = modules_after(FIRST_STEP.replace("print(", f"accelerator.save_state({str(tmp_path / 'ckpt')!r})\nprint(", 1),
                          tmp_path)
    assert {"torchrig.checkpoint.manager", "safetensors"} <= saved
