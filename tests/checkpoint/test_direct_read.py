"""Loading a safetensors file straight into live tensors (checkpoint.direct_read): the same values
the library reads, in the live tensors themselves, and a damaged file refused before any byte
lands in them."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file
from torchrig import Accelerator
from torchrig.checkpoint import CheckpointError
from torchrig.checkpoint.direct_read import read_into
from torchrig.checkpoint.hashed_safetensors import DTYPE_CODES


def _values() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    out = {}
    for dtype in DTYPE_CODES:
        base = torch.randn(4, 3, generator=generator) * 40
        if dtype == torch.bool:
            out[str(dtype)] = base > 0
        elif dtype == torch.complex64:
            out[str(dtype)] = torch.complex(base, base / 2)
        elif dtype in (torch.uint16, torch.uint32, torch.uint64):
            out[str(dtype)] = base.abs().to(torch.int64).to(dtype)
        else:
            out[str(dtype)] = base.to(dtype)
    out["scalar"] = torch.tensor(7.25)
    out["empty"] = torch.empty(0, 5)
    return out


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def test_matching_live_tensors_are_read_in_place_with_the_librarys_bytes(tmp_path):
    path = str(tmp_path / "s.safetensors")
    save_file(_values(), path, metadata={"k": "v"})
    expected = load_file(path)
    live = {name: torch.zeros_like(value) for name, value in expected.items()}
    addresses = {name: value.data_ptr() for name, value in live.items()}
    state, metadata = read_into(path, live)
    assert metadata == {"k": "v"}
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert state[name] is live[name], name  # the live tensor itself...
        assert live[name].data_ptr() == addresses[name]  # ...in its own memory...
        assert torch.equal(_bits(live[name]), _bits(value)), name  # ...holding the file's bytes


def test_tensors_that_do_not_match_are_read_by_the_library_and_the_live_ones_kept(tmp_path):
    path = str(tmp_path / "s.safetensors")
    save_file({"shape": torch.ones(2, 3), "dtype": torch.ones(4), "strided": torch.arange(6.0).reshape(2, 3),
               "absent": torch.full((2,), 5.0), "same": torch.full((3,), 2.0)}, path)
    live = {"shape": torch.zeros(3, 2), "dtype": torch.zeros(4, dtype=torch.float64),
            "strided": torch.zeros(3, 2).t(), "same": torch.zeros(3), "extra": torch.zeros(1)}
    state, _ = read_into(path, live)
    assert state.keys() == {"shape", "dtype", "strided", "absent", "same"}
    assert state["same"] is live["same"] and torch.equal(live["same"], torch.full((3,), 2.0))
    for name in ("shape", "dtype", "strided"):
        assert state[name] is not live[name] and not live[name].any(), name  # untouched
    assert torch.equal(state["strided"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(state["absent"], torch.full((2,), 5.0))


@pytest.mark.parametrize("damage", ["short", "header_length", "not_json", "offsets_past_end", "size_mismatch"])
def test_a_damaged_file_is_refused_before_any_live_tensor_changes(tmp_path, damage):
    path = tmp_path / "s.safetensors"
    save_file({"a": torch.ones(8), "b": torch.ones(4)}, str(path))
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    if damage == "short":
        raw = raw[:5]
    elif damage == "header_length":
        raw = struct.pack("<Q", len(raw) * 2) + raw[8:]
    elif damage == "not_json":
        raw = raw[:8] + b"{" * length + raw[8 + length:]
    else:
        first, end = header["b"]["data_offsets"]
        header["b"]["data_offsets"] = [first, end + 4096] if damage == "offsets_past_end" else [first, end - 4]
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        raw = struct.pack("<Q", len(encoded)) + encoded + raw[8 + length:]
    path.write_bytes(raw)
    live = {"a": torch.zeros(8), "b": torch.zeros(4)}
    with pytest.raises(CheckpointError, match=str(path)):
        read_into(str(path), live)
    assert not live["a"].any() and not live["b"].any()


def test_load_state_restores_into_the_models_and_optimizers_own_tensors(tmp_path):
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, project_dir=str(tmp_path))
    model = torch.nn.ModuleDict({"mlp": torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)),
                                 "embed": torch.nn.Embedding(8, 8), "head": torch.nn.Linear(8, 8, bias=False)})
    model["head"].weight = model["embed"].weight  # tied weights: saved once, restored as one
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    first = model["mlp"][0].weight
    (model["mlp"](torch.randn(4, 8)).sum() + model["head"](model["embed"](torch.arange(4))).sum()).backward()
    optimizer.step()
    accelerator.save_state(str(tmp_path / "ckpt"))
    saved_params = [p.detach().clone() for p in model.parameters()]
    saved_state = {k: v.clone() for k, v in optimizer.optimizer.state[first].items()}
    live = [p.data_ptr() for p in model.parameters()]
    live_state = {k: v.data_ptr() for k, v in optimizer.optimizer.state[first].items()}
    optimizer.step()  # move away from the checkpoint
    accelerator.load_state(str(tmp_path / "ckpt"))
    for param, value, address in zip(model.parameters(), saved_params, live):
        assert torch.equal(param, value) and param.data_ptr() == address
    assert model["head"].weight is model["embed"].weight
    for key, value in optimizer.optimizer.state[first].items():
        assert torch.equal(value, saved_state[key]) and value.data_ptr() == live_state[key], key
