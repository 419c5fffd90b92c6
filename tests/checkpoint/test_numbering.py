"""Automatic checkpoint numbering after a person renamed a checkpoint directory (issue 40, item 11):
numbering continues after every directory there, whatever its name, so no save collides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torchrig import Accelerator
from torchrig.checkpoint import layout
from torchrig.config.options import ProjectConfiguration


def make_run(project: Path, total_limit: int | None):
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project), automatic_checkpoint_naming=True, total_limit=total_limit))
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    return accelerator, model


@pytest.mark.parametrize("total_limit", [None, 3])
@pytest.mark.parametrize("new_name", ["checkpoint_9.bak", "backup", "checkpoint_9_old", ".checkpoint_9"])
def test_saves_after_the_newest_checkpoint_was_renamed_never_collide(tmp_path, total_limit, new_name):
    accelerator, model = make_run(tmp_path, total_limit)
    for step in range(10):
        with torch.no_grad():
            model.weight.fill_(step)
        accelerator.save_state()
    root = tmp_path / "checkpoints"
    os.rename(root / "checkpoint_9", root / new_name)

    accelerator, model = make_run(tmp_path, total_limit)
    loaded = accelerator.load_state()
    expected_source = root / (new_name if not new_name.startswith(".") else "checkpoint_8")
    assert loaded == str(expected_source)
    assert float(model.weight[0, 0]) == (9.0 if not new_name.startswith(".") else 8.0)
    saved = [accelerator.save_state() for _ in range(8)]  # none may fail on a numbering collision
    numbers = [layout.automatic_number(os.path.basename(path)) for path in saved]
    assert numbers == list(range(10, 18)), numbers
    assert (root / new_name).is_dir()  # the renamed directory is never rotated away nor overwritten
    assert layout.latest_checkpoint(str(root)) == saved[-1]


def test_a_renamed_copy_with_a_higher_number_moves_numbering_past_it(tmp_path):
    accelerator, _ = make_run(tmp_path, None)
    for _ in range(3):
        accelerator.save_state()
    root = tmp_path / "checkpoints"
    os.rename(root / "checkpoint_2", root / "checkpoint_40.keep")
    accelerator, _ = make_run(tmp_path, None)
    accelerator.load_state(str(root / "checkpoint_1"))  # an older one, on purpose
    assert os.path.basename(accelerator.save_state()) == "checkpoint_41"
