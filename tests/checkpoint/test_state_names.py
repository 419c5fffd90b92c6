"""Names in saved state (issue 40, item 13): keys of a registered object that collide once
flattened round-trip exactly, a tensor named ``__metadata__`` is refused at save naming it, and a
manifest path with a NUL byte is a checkpoint error naming the entry. Real saves, read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torchrig import Accelerator
from torchrig.checkpoint import MANIFEST_NAME, CheckpointError, layout
from torchrig.config.options import ProjectConfiguration


class Holder:
    """A registered object whose state is whatever the test gives it."""

    def __init__(self, state: dict) -> None:
        self.state = state

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = state


def colliding_state() -> dict:
    return {"a.b": torch.full((2,), 1.0), "a": {"b": torch.full((2,), 2.0)},
            1: torch.full((3,), 3.0), "1": torch.full((3,), 4.0),
            "a.b#1": torch.full((1,), 5.0), "list": [torch.full((1,), 6.0), {"0": torch.full((1,), 7.0)}]}


def assert_same(loaded, expected, where: str = "state") -> None:
    assert type(loaded) is type(expected), where
    if isinstance(expected, torch.Tensor):
        assert torch.equal(loaded, expected), where
    elif isinstance(expected, dict):
        assert list(loaded.keys()) == list(expected.keys()), where
        for key in expected:
            assert_same(loaded[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(loaded) == len(expected), where
        for index, (a, b) in enumerate(zip(loaded, expected)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert loaded == expected, where


@pytest.mark.parametrize("hashes", [False, True])
def test_keys_that_collide_once_flattened_round_trip_exactly(tmp_path, hashes):
    accelerator = Accelerator(cpu=True)
    holder = Holder(colliding_state())
    accelerator.register_for_checkpointing(holder)
    directory = accelerator.save_state(str(tmp_path / "ckpt"), hashes=hashes)
    holder.state = {}
    accelerator.load_state(directory, verify_hashes=hashes)
    assert_same(holder.state, colliding_state())


class WithReservedName(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.register_buffer("__metadata__", torch.ones(2))


@pytest.mark.parametrize("hashes", [False, True])
def test_a_tensor_named_metadata_is_refused_at_save_naming_it(tmp_path, hashes):
    accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    model = accelerator.prepare(WithReservedName())
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*'__metadata__'.*rename"):
        accelerator.save_state(hashes=hashes)
    root = tmp_path / "checkpoints"
    assert layout.latest_checkpoint(str(root)) is None  # nothing committed
    assert [p.name for p in root.iterdir() if p.name != "latest"] == []  # nor left half-written
    assert torch.equal(model.get_buffer("__metadata__"), torch.ones(2))


def test_a_manifest_path_with_a_nul_byte_is_a_checkpoint_error_naming_the_entry(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    directory = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["files"][0]["path"] = "model\x00.safetensors"
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    with torch.no_grad():  # the live model moves away from the checkpoint: a refusal must leave it there
        model.weight.add_(1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"torchrig_checkpoint\.json.*files\[0\]\.path.*NUL"):
        accelerator.load_state(str(directory))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_save_model_refuses_a_tensor_named_metadata_before_writing_anything(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(WithReservedName())
    with pytest.raises(CheckpointError, match=r"'__metadata__'.*safe_serialization=False"):
        accelerator.save_model(model, tmp_path / "export")
    assert not (tmp_path / "export").exists()
