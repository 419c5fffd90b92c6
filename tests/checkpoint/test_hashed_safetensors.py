"""Safetensors files written while hashed (checkpoint.hashed_safetensors) are what the library
reads, and their digest is the file's."""

from __future__ import annotations

import hashlib

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torchrig.checkpoint import hashed_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    out = {}
    for dtype in hashed_safetensors.DTYPE_CODES:
        base = torch.randn(3, 5, generator=generator) * 50
        if dtype == torch.bool:
            value = base > 0
        elif dtype == torch.complex64:
            value = torch.complex(base, -base)
        elif dtype in (torch.uint16, torch.uint32, torch.uint64):
            value = base.abs().to(torch.int64).to(dtype)
        else:
            value = base.to(dtype)
        out[f"t_{str(dtype).split('.')[-1]}"] = value
    out["scalar"] = torch.tensor(3.5)
    out["empty"] = torch.empty(0, 4)
    out["transposed"] = torch.arange(12.0).reshape(3, 4).t()  # not contiguous: written in logical order
    return out


def test_every_dtype_and_shape_round_trips_through_the_library_with_the_files_digest(tmp_path):
    tensors = _tensors()
    path = str(tmp_path / "t.safetensors")
    digest = hashed_safetensors.write_hashed(path, tensors, metadata={"format": "pt", "k": "v"}).result()
    assert digest == hashlib.sha256(open(path, "rb").read()).hexdigest()
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape, name
        # bit for bit (float8 has no equality kernel on CPU; NaN would not compare equal)
        assert torch.equal(loaded[name].reshape(-1).view(torch.uint8), value.contiguous().reshape(-1).view(torch.uint8))
    with safe_open(path, framework="pt") as handle:
        assert handle.metadata() == {"format": "pt", "k": "v"}


def test_without_metadata_the_file_reads_with_no_metadata(tmp_path):
    path = str(tmp_path / "t.safetensors")
    digest = hashed_safetensors.write_hashed(path, {"a": torch.ones(2), "b": torch.zeros(3, dtype=torch.int8)}).result()
    assert digest == hashlib.sha256(open(path, "rb").read()).hexdigest()
    with safe_open(path, framework="pt") as handle:
        assert not handle.metadata()
        assert torch.equal(handle.get_tensor("a"), torch.ones(2))


def test_dtypes_outside_the_table_are_not_supported_here():
    assert hashed_safetensors.supported({"a": torch.ones(1)})
    assert not hashed_safetensors.supported({"a": torch.ones(1, dtype=torch.complex128)})
    assert not hashed_safetensors.supported({"a": torch.ones(2).to_sparse()})
