"""The own safetensors reader accepts exactly what the ``safetensors`` library accepts (issue 40,
item 13): a property test compares verdicts on generated and mutated files, and a refused file
never changes a live tensor. Real files, read back by both readers."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torchrig.checkpoint import CheckpointError
from torchrig.checkpoint.direct_read import read_into

#: dtypes torch reads through the library (its full-load verdict is then the header's verdict).
TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
         "F8_E4M3": 1, "F8_E5M2": 1}


class Raw(str):
    """A JSON literal written as is (NaN, -0, 2.0, 1e400...)."""


class Obj(list):
    """A JSON object as key/value pairs: duplicates can be written."""


def dumps(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, Obj):
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


def file_bytes(header: Any, data: bytes, *, pad: bool = True, length_delta: int = 0) -> bytes:
    text = dumps(header).encode("utf-8", "surrogatepass")
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", max(0, len(text) + length_delta)) + text + data


def valid_header(specs: list[tuple[str, str, list[int]]]) -> tuple[Obj, int]:
    header, offset = Obj(), 0
    for name, dtype, shape in specs:
        size = BYTES[dtype] * (int(torch.tensor(shape).prod()) if shape else 1)
        header.append((name, Obj([("dtype", dtype), ("shape", list(shape)), ("data_offsets", [offset, offset + size])])))
        offset += size
    return header, offset


def library_verdict(path: Path) -> bool:
    """Whether the library loads every tensor of the file (framework pt)."""
    try:
        with safe_open(str(path), framework="pt") as library:
            for name in library.keys():
                library.get_tensor(name)
            library.metadata()
    except Exception:
        return False
    return True


def live_targets(header: Any) -> dict[str, torch.Tensor]:
    """Zeroed live tensors for every entry that looks like a tensor torch can hold."""
    live = {}
    for name, entry in header if isinstance(header, Obj) else []:
        fields = dict(entry) if isinstance(entry, Obj) else {}
        shape, dtype = fields.get("shape"), fields.get("dtype")
        if (dtype in TORCH_DTYPES and isinstance(shape, list) and len(shape) <= 3
                and all(type(n) is int and 0 <= n <= 16 for n in shape)):
            live[name] = torch.zeros(shape, dtype=TORCH_DTYPES[dtype])
    return live


names = st.sampled_from(["a", "b", "c", "w.x", "__metadata__x"])
specs = st.lists(st.tuples(names, st.sampled_from(sorted(TORCH_DTYPES)),
                           st.lists(st.integers(0, 4), max_size=3)), max_size=4, unique_by=lambda s: s[0])
odd_numbers = st.sampled_from([Raw("-1"), Raw("-0"), Raw("2.0"), Raw("1e400"), Raw("NaN"), Raw("18446744073709551616"),
                               Raw("true"), Raw("null"), Raw('"2"'), Raw("3"), Raw("0")])


@st.composite
def mutated_files(draw) -> tuple[Any, bytes]:
    specs_drawn = draw(specs)
    header, data_size = valid_header(specs_drawn)
    data = bytes((i * 37 + 11) % 251 + 1 for i in range(data_size))  # no zero byte: a landed read shows
    pad, length_delta = True, 0
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from([
            "overlap", "shift", "swap", "dtype", "shape", "drop_field", "dup_field", "extra_field", "metadata",
            "data_size", "header_length", "as_array", "dup_tensor", "flip_byte", "no_pad", "top_level"]))
        entries = [entry for _, entry in header] if isinstance(header, Obj) else []
        objects = [e for e in entries if isinstance(e, Obj)]
        pick = draw(st.integers(0, 10))
        if kind in ("overlap", "swap") and len(objects) >= 2:
            first, second = objects[pick % len(objects)], objects[(pick + 1) % len(objects)]
            a, b = dict(first).get("data_offsets", [0, 0]), dict(second).get("data_offsets", [0, 0])
            second[:] = [(k, (list(a) if kind == "overlap" else v) if k == "data_offsets" else v) for k, v in second]
            if kind == "swap":
                first[:] = [(k, list(b) if k == "data_offsets" else v) for k, v in first]
                second[:] = [(k, list(a) if k == "data_offsets" else v) for k, v in second]
        elif kind == "shift" and objects:
            target = objects[pick % len(objects)]
            delta, which = draw(st.integers(-3, 3)), draw(st.integers(0, 1))
            target[:] = [(k, [max(0, n + delta) if i == which else n for i, n in enumerate(v)]
                          if k == "data_offsets" and isinstance(v, list) else v) for k, v in target]
        elif kind == "dtype" and objects:
            target = objects[pick % len(objects)]
            new = draw(st.sampled_from(["F32", "I8", "F64", "F4", "f32", "F128", "C64", "F6_E2M3", 3]))
            target[:] = [(k, new if k == "dtype" else v) for k, v in target]
        elif kind == "shape" and objects:
            target = objects[pick % len(objects)]
            odd = draw(odd_numbers)
            target[:] = [(k, [*v, odd] if k == "shape" and isinstance(v, list) else v) for k, v in target]
        elif kind == "drop_field" and any(objects):
            target = [o for o in objects if o][0]
            del target[pick % len(target)]
        elif kind == "dup_field" and any(objects):
            target = [o for o in objects if o][0]
            target.append(target[pick % len(target)])
        elif kind == "extra_field" and objects:
            objects[pick % len(objects)].append(("extra", draw(st.sampled_from([1, Raw("NaN"), [1, [2]], "x", None]))))
        elif kind == "metadata" and isinstance(header, Obj):
            value = draw(st.sampled_from([Obj([("k", "v")]), Obj([("k", 1)]), Obj([("k", None)]), Raw("null"), [],
                                          Obj(), Obj([("k", "v"), ("k", "w")]), Obj([("k", Obj())])]))
            header.insert(pick % (len(header) + 1), ("__metadata__", value))
            if draw(st.booleans()):
                header.append(("__metadata__", Obj()))
        elif kind == "data_size":
            delta = draw(st.integers(-3, 3))
            data = data[:max(0, len(data) + delta)] if delta < 0 else data + b"\x07" * delta
        elif kind == "header_length":
            length_delta = draw(st.sampled_from([-8, -1, 1, 8, 10**9]))
        elif kind == "as_array" and isinstance(header, Obj) and header:
            index = pick % len(header)
            name, entry = header[index]
            if isinstance(entry, Obj):
                fields = dict(entry)
                header[index] = (name, [fields.get(k, 0) for k in ("dtype", "shape", "data_offsets")])
        elif kind == "dup_tensor" and isinstance(header, Obj) and header:
            header.append(header[pick % len(header)])
        elif kind == "flip_byte":
            text = bytearray(dumps(header).encode())
            if text:
                text[pick * 7 % len(text)] = draw(st.sampled_from(list(b'{}[]",:0 1\x00\xff-')))
            header = Raw(text.decode("latin-1"))
        elif kind == "no_pad":
            pad = False
        elif kind == "top_level":
            header = draw(st.sampled_from([[], Raw('"x"'), Raw("1"), Raw(""), Obj()]))
    raw = file_bytes(header, data, pad=pad, length_delta=length_delta)
    if isinstance(header, Raw):  # a flipped byte: keep it byte-exact (no re-encoding of \xff)
        text = str(header).encode("latin-1")
        text += b" " * (-len(text) % 8)
        # an unsigned length: a shortened empty header declares 0
        raw = struct.pack("<Q", max(0, len(text) + length_delta)) + text + data
    return header, raw


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(case=mutated_files())
def test_the_readers_verdict_is_the_librarys_and_a_refusal_changes_nothing(tmp_path, case):
    header, raw = case
    path = tmp_path / "case.safetensors"
    path.write_bytes(raw)
    live = live_targets(header)
    accepted = library_verdict(path)
    try:
        state, _ = read_into(str(path), live)
    except CheckpointError as exc:
        assert not accepted, f"refused a file the library loads: {exc}"
        assert str(path) in str(exc)
        assert all(not tensor.view(-1).view(torch.uint8).any() for tensor in live.values() if tensor.numel()), \
            "a refused file changed a live tensor"
        return
    assert accepted, f"loaded a file the library refuses: {raw[:200]!r}"
    expected = load_file(str(path))
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(state[name].view(-1).view(torch.uint8), value.contiguous().view(-1).view(torch.uint8))


def write_raw(path: Path, header: Any, data: bytes) -> None:
    path.write_bytes(file_bytes(header, data))


def test_overlapping_offsets_are_refused_before_any_live_tensor_changes(tmp_path):
    path = tmp_path / "overlap.safetensors"
    header = Obj([("a", Obj([("dtype", "F32"), ("shape", [2]), ("data_offsets", [0, 8])])),
                  ("b", Obj([("dtype", "F32"), ("shape", [2]), ("data_offsets", [0, 8])]))])
    write_raw(path, header, struct.pack("<2f", 1.5, 2.5))
    live = {"a": torch.zeros(2), "b": torch.zeros(2)}
    assert not library_verdict(path)
    with pytest.raises(CheckpointError, match=r"overlap\.safetensors.*tensor 'b'.*overlaps"):
        read_into(str(path), live)
    assert not live["a"].any() and not live["b"].any()


def test_a_gap_and_trailing_bytes_are_refused(tmp_path):
    gap = tmp_path / "gap.safetensors"
    write_raw(gap, Obj([("a", Obj([("dtype", "F32"), ("shape", [1]), ("data_offsets", [4, 8])]))]), bytes(8))
    trailing = tmp_path / "trailing.safetensors"
    write_raw(trailing, Obj([("a", Obj([("dtype", "F32"), ("shape", [1]), ("data_offsets", [0, 4])]))]), bytes(12))
    for path, problem in ((gap, "leaves a gap"), (trailing, "cover 4 bytes of data, the file holds 12")):
        live = {"a": torch.zeros(1)}
        with pytest.raises(CheckpointError, match=problem):
            read_into(str(path), live)
        assert not live["a"].any()


@pytest.mark.parametrize("value", [1, None, ["x"], {"nested": "x"}])
def test_metadata_values_that_are_not_strings_are_refused_clearly(tmp_path, value):
    path = tmp_path / "meta.safetensors"
    write_raw(path, Obj([("__metadata__", Obj([("torchrig_structure", value)])),
                         ("a", Obj([("dtype", "F32"), ("shape", [1]), ("data_offsets", [0, 4])]))]), bytes(4))
    live = {"a": torch.zeros(1)}
    assert not library_verdict(path)
    with pytest.raises(CheckpointError, match=r"meta\.safetensors.*__metadata__ must map strings to strings, "
                                              r"but 'torchrig_structure' holds"):
        read_into(str(path), live)
    assert not live["a"].any()


def test_what_the_library_accepts_loads_entries_as_arrays_and_null_metadata(tmp_path):
    path = tmp_path / "odd_but_valid.safetensors"
    write_raw(path, Obj([("__metadata__", Raw("null")), ("a", ["F32", [2], [0, 8]]),
                         ("z", Obj([("dtype", "F32"), ("shape", [0]), ("data_offsets", [8, 8]), ("extra", 1)]))]),
              struct.pack("<2f", 1.0, 2.0))
    assert library_verdict(path)
    live = {"a": torch.zeros(2)}
    state, metadata = read_into(str(path), live)
    assert state["a"] is live["a"] and live["a"].tolist() == [1.0, 2.0] and metadata == {}
    assert state["z"].shape == (0,)


def test_files_the_library_writes_still_load_in_place(tmp_path):
    path = tmp_path / "lib.safetensors"
    save_file({"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3, dtype=torch.int64)}, str(path),
              metadata={"k": "v"})
    live = {"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.int64)}
    state, metadata = read_into(str(path), live)
    assert state["w"] is live["w"] and torch.equal(live["w"], torch.arange(6.0).reshape(2, 3))
    assert metadata == {"k": "v"}
