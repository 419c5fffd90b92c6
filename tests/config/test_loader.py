"""Tests of torchrig.config.loader: strict YAML/JSON reading with file:line:column everywhere."""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys
import textwrap

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torchrig.config.loader import Document, Mark, load_file, load_text, resolve_extends
from torchrig.errors import ConfigError

FSDP_CONFIG = (pathlib.Path(__file__).parents[2] / "plugins" / "fsdp" / "tests" / "data" / "accelerate_fsdp_config.yaml").read_text()

MULTI_GPU_CONFIG = (pathlib.Path(__file__).parents[1] / "compat" / "data" / "accelerate_multi_gpu_config.yaml").read_text()


def write(tmp_path, name, text):
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def error_of(text, file="cfg.yaml", **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_text(text, file, **kwargs)
    return str(info.value)


# ------------------------------------------------------------------------ Accelerate configs


def test_fsdp_config_loads_with_types(tmp_path):
    doc = load_file(write(tmp_path, "default_config.yaml", FSDP_CONFIG))
    assert isinstance(doc, Document)
    assert doc.data == yaml.safe_load(FSDP_CONFIG)
    assert doc.data["fsdp_config"]["fsdp_forward_prefetch"] is False
    assert doc.data["fsdp_config"]["fsdp_use_orig_params"] is True
    assert doc.data["num_processes"] == 8 and doc.data["main_process_ip"] is None
    assert doc.data["downcast_bf16"] == "no"
    assert ("downcast_bf16",) not in doc.raw_scalars  # quoted: a string already
    assert doc.raw_scalars[("num_processes",)] == "8"
    assert doc.raw_scalars[("fsdp_config", "fsdp_forward_prefetch")] == "false"
    assert doc.raw_scalars[("main_process_ip",)] == "null"
    assert ("mixed_precision",) not in doc.raw_scalars  # bf16 is a plain string


def test_multi_gpu_config_keeps_raw_no(tmp_path):
    doc = load_file(write(tmp_path, "default_config.yaml", MULTI_GPU_CONFIG))
    assert doc.data["distributed_type"] == "MULTI_GPU"
    assert doc.data["mixed_precision"] is False  # YAML 1.1, as safe_load reads it ...
    assert doc.raw_scalars[("mixed_precision",)] == "no"  # ... but the source text is kept
    assert doc.data["downcast_bf16"] == "no"
    assert ("downcast_bf16",) not in doc.raw_scalars
    assert doc.data["tpu_env"] == [] and doc.data["gpu_ids"] == "all"
    assert doc.data == yaml.safe_load(MULTI_GPU_CONFIG)


def test_marks_of_nested_key(tmp_path):
    path = write(tmp_path, "cfg.yaml", FSDP_CONFIG)
    doc = load_file(path)
    mark = doc.marks[("fsdp_config", "fsdp_sharding_strategy")]
    assert (mark.line, mark.column) == (9, 3)
    assert mark.file == str(path)
    assert str(mark) == f"{path}:9:3"
    assert doc.where(("fsdp_config", "fsdp_sharding_strategy")) == f"{path}:9:3"
    assert str(doc.marks[("use_cpu",)]) == f"{path}:21:1"
    # An unknown path falls back to its nearest ancestor; the empty path is the document.
    assert doc.mark(("fsdp_config", "no_such_key", 3)) == doc.marks[("fsdp_config",)]
    assert doc.mark(()) == Mark(str(path), 1, 1)


def test_marks_of_list_items_and_flow():
    doc = load_text("a:\n  - x\n  - {b: [1, 2]}\n")
    assert str(doc.marks[("a", 0)]) == "<string>:2:5"
    assert str(doc.marks[("a", 1)]) == "<string>:3:5"
    assert str(doc.marks[("a", 1, "b", 1)]) == "<string>:3:13"


def test_raw_scalars_only_for_plain_non_strings():
    doc = load_text('a: yes\nb: "yes"\nc: 0x10\nd: 1_000\ne: ~\nf: 1.5\ng: text\nh: !!str on\n')
    assert doc.data == {"a": True, "b": "yes", "c": 16, "d": 1000, "e": None, "f": 1.5, "g": "text", "h": "on"}
    assert dict(doc.raw_scalars) == {("a",): "yes", ("c",): "0x10", ("d",): "1_000", ("e",): "~", ("f",): "1.5"}


def test_timestamps_stay_strings():
    assert load_text("date: 2024-01-01\nbad: 2024-99-99\n").data == {"date": "2024-01-01", "bad": "2024-99-99"}


def test_anchors_aliases_and_merge_keys_match_safe_load():
    text = "base: &b {lr: 0.1, wd: 0.0}\nrun:\n  <<: *b\n  lr: 0.2\nlist: [*b]\nboth: {<<: [{x: 1}, {x: 2, y: 2}]}\n"
    doc = load_text(text)
    assert doc.data == yaml.safe_load(text)
    assert doc.data["run"] == {"lr": 0.2, "wd": 0.0}
    assert str(doc.marks[("run", "lr")]) == "<string>:4:3"
    assert str(doc.marks[("run", "wd")]) == "<string>:1:20"  # where the merged value is written


# --------------------------------------------------------------------------- rejections


def test_duplicate_top_level_key():
    text = "compute_environment: LOCAL_MACHINE\nmixed_precision: bf16\nnum_processes: 8\nmixed_precision: no\n"
    message = error_of(text)
    assert "duplicate key 'mixed_precision' at cfg.yaml:4:1 (first defined at cfg.yaml:2:1)" in message


def test_duplicate_nested_key():
    message = error_of("fsdp_config:\n  a: 1\n  b: 2\n  a: 3\n")
    assert "duplicate key 'a' at cfg.yaml:4:3 (first defined at cfg.yaml:2:3)" in message
    # Quoting does not make it a different key.
    assert "duplicate key 'a'" in error_of("x: {a: 1, 'a': 2}\n")


def test_all_problems_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_text("a: 1\na: 2\nb: {c: 1, c: 2}\n1: x\n", "f")
    assert len(info.value.problems) == 3
    assert any("key 1 at f:4:1 must be a string" in p for p in info.value.problems)


def test_duplicate_key_json():
    text = '{\n  "a": 1,\n  "b": {"c": 1, "c": 2},\n  "a": 3\n}\n'
    message = error_of(text, "cfg.json")
    assert "duplicate key 'c' at cfg.json:3:17 (first defined at cfg.json:3:9)" in message
    assert "duplicate key 'a' at cfg.json:4:3 (first defined at cfg.json:2:3)" in message


def test_non_string_keys_rejected_at_any_level():
    assert "key 1 at f:3:1 must be a string" in error_of("a: 1\nb: 2\n1: 3\n", "f")
    assert "key yes at f:2:3 must be a string" in error_of("a:\n  yes: 1\n", "f")
    assert "key at f:1:3 must be a string, not a list" in error_of("? [1]\n: 2\n", "f")


def test_malformed_yaml_has_line_and_column():
    message = error_of("a: 1\nb:\n  c: d: e\n")
    assert "cfg.yaml:3:7: malformed YAML: mapping values are not allowed here" in message
    assert "cfg.yaml:2:1: malformed YAML" in error_of("a: [1, 2\n")
    assert "cfg.yaml:1:4: malformed YAML: unacceptable character U+0007" in error_of("a: \x07\n")


def test_malformed_json_has_line_and_column():
    message = error_of('{\n  "a": 1,\n  "b": \n}\n', "cfg.json")
    assert "cfg.json:4:1: malformed JSON: Expecting value" in message
    assert "x.txt:1:9: malformed JSON" in error_of('{"a": 1,}', "x.txt", format="json")


def test_multiple_documents_rejected():
    assert "cfg.yaml:2:1: a second YAML document" in error_of("a: 1\n---\nb: 2\n")
    assert load_text("---\na: 1\n...\n").data == {"a": 1}  # one explicit document is fine


def test_top_level_must_be_a_mapping():
    assert "top level must be a mapping" in error_of("- a\n- b\n")
    assert "top level must be a mapping" in error_of("just text\n")
    assert "top level must be a JSON object" in error_of("[1, 2]", "cfg.json")
    assert load_text("").data == {} and load_text("# only a comment\n").data == {}
    assert load_text("", "cfg.json").data == {}


def test_unsupported_tags_and_bad_scalars():
    assert "unsupported tag !!python/tuple" in error_of("a: !!python/tuple [1, 2]\n")
    assert "unsupported tag !custom" in error_of("a: !custom x\n")
    assert "unsupported tag !!binary" in error_of("a: !!binary aGk=\n")
    assert "unsupported tag !!set" in error_of("a: !!set {x, y}\n")
    assert "cfg.yaml:1:4: cannot read '0b_' as !!int" in error_of("a: 0b_\n")  # safe_load: ValueError


def test_recursive_and_exploding_aliases_rejected():
    assert "recursive" in error_of("a: &a [1, *a]\n")
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n"
    for i, name in enumerate("bcdefg"):
        prev = "abcdefg"[i]
        laughs += f"{name}: &{name} [{', '.join([f'*{prev}'] * 10)}]\n"
    assert "too many" in error_of(laughs)
    assert "nested too deeply" in error_of("a: " + "[" * 5000 + "]" * 5000)


def test_unreadable_files(tmp_path):
    missing = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match="missing.yaml: no such file"):
        load_file(missing)
    with pytest.raises(ConfigError, match="is a directory"):
        load_file(tmp_path)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("a: 1\nname: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml:2:10: not valid UTF-8 \(byte 0xe9"):
        load_file(latin1)
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError, match="model.bin: is a binary file"):
        load_file(binary)
    utf16 = tmp_path / "utf16.json"
    utf16.write_text('{"a": 1}', encoding="utf-16")
    with pytest.raises(ConfigError, match="UTF-16"):
        load_file(utf16)
    bom = tmp_path / "bom.json"
    bom.write_bytes(b'\xef\xbb\xbf{"a": 1}')
    assert load_file(bom).data == {"a": 1}


@pytest.mark.skipif(sys.platform == "win32" or (hasattr(os, "geteuid") and os.geteuid() == 0), reason="root reads all")
def test_permission_denied(tmp_path):
    path = write(tmp_path, "secret.yaml", "a: 1\n")
    path.chmod(0)
    try:
        with pytest.raises(ConfigError, match="permission denied"):
            load_file(path)
    finally:
        path.chmod(0o600)


def test_json_marks_and_format_guess(tmp_path):
    text = '{\n\t"zero_optimization": {\n\t\t"stage": 3\n\t},\n\t"bf16": {"enabled": true}\n}\n'
    path = write(tmp_path, "ds_config.json", text)
    doc = load_file(path)
    assert doc.data == {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    assert str(doc.marks[("zero_optimization", "stage")]) == f"{path}:3:3"
    assert doc.raw_scalars == {}
    # YAML composition of this JSON fails (a 2000-char key): marks fall back to the file alone.
    long_key = "k" * 2000
    doc = load_text(json.dumps({long_key: {"x": 1}}), "big.json")
    assert doc.data == {long_key: {"x": 1}}
    assert doc.where((long_key, "x")) in ("big.json", "big.json:1:1", "big.json:1:2")


def test_bad_format_argument():
    with pytest.raises(ValueError, match="format"):
        load_text("a: 1", format="toml")


# ------------------------------------------------------------------------------- extends


def test_extends_chain_of_three(tmp_path):
    write(tmp_path, "base.yaml", "lr: 0.1\nepochs: 1\nname: base\n")
    write(tmp_path, "mid/mid.yaml", "extends: ../base.yaml\nepochs: 2\nname: mid\n")
    top = write(tmp_path, "mid/top.yaml", "extends: mid.yaml\nname: top\n")
    docs = resolve_extends(top)
    assert [os.path.basename(d.file) for d in docs] == ["base.yaml", "mid.yaml", "top.yaml"]
    assert [d.data for d in docs] == [
        {"lr": 0.1, "epochs": 1, "name": "base"},
        {"epochs": 2, "name": "mid"},
        {"name": "top"},
    ]
    assert all("extends" not in d.data and ("extends",) not in d.marks for d in docs)
    assert str(docs[1].marks[("epochs",)]).endswith("mid.yaml:2:1")
    merged = {}
    for doc in docs:
        merged.update(doc.data)
    assert merged == {"lr": 0.1, "epochs": 2, "name": "top"}


def test_extends_list_later_wins_and_diamond_once(tmp_path):
    write(tmp_path, "common.yaml", "a: common\n")
    write(tmp_path, "x.yaml", "extends: common.yaml\nb: x\n")
    write(tmp_path, "y.json", '{"extends": "common.yaml", "b": "y"}')
    top = write(tmp_path, "top.yaml", "extends: [x.yaml, y.json]\nc: top\n")
    docs = resolve_extends(top)
    assert [os.path.basename(d.file) for d in docs] == ["common.yaml", "x.yaml", "y.json", "top.yaml"]
    assert docs[2].data == {"b": "y"}


def test_extends_relative_to_extending_file(tmp_path):
    write(tmp_path, "configs/base.yaml", "a: 1\n")
    write(tmp_path, "configs/exp/run.yaml", "extends: ../base.yaml\nb: 2\n")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        docs = resolve_extends("configs/exp/run.yaml")
    finally:
        os.chdir(cwd)
    assert [d.file for d in docs] == [os.path.join("configs", "base.yaml"), "configs/exp/run.yaml"]
    assert docs[0].data == {"a": 1}


def test_extends_cycle(tmp_path):
    write(tmp_path, "a.yaml", "extends: b.yaml\n")
    write(tmp_path, "b.yaml", "x: 1\nextends: [c.yaml]\n")
    write(tmp_path, "c.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match=r"cycle: .*a\.yaml -> .*b\.yaml -> .*c\.yaml -> .*a\.yaml"):
        resolve_extends(tmp_path / "a.yaml")
    write(tmp_path, "self.yaml", "extends: self.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        resolve_extends(tmp_path / "self.yaml")


def test_extends_missing_and_invalid(tmp_path):
    top = write(tmp_path, "top.yaml", "a: 1\nextends:\n  - nothere.yaml\n")
    with pytest.raises(ConfigError) as info:
        resolve_extends(top)
    assert f"{top}:3:5: extends 'nothere.yaml'" in str(info.value)
    assert "nothere.yaml does not exist" in str(info.value)
    write(tmp_path, "broken.yaml", "a: [\n")
    bad = write(tmp_path, "bad.yaml", "extends: broken.yaml\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:2:1: malformed YAML.*extended by .*bad.yaml:1:1"):
        resolve_extends(bad)
    weird = write(tmp_path, "weird.yaml", "extends: 3\n")
    with pytest.raises(ConfigError, match="'extends' must be a path or a list of paths"):
        resolve_extends(weird)


# ---------------------------------------------------------------------------- properties

YAMLISH_TOKENS = [
    "a", "key", "b_c", "no", "yes", "1", "0x_", "0b_", "1.5e3", "._", ".inf", "~", "null", "2024-99-99",
    "=", "<<", ":", ": ", "-", "- ", " ", "  ", "\t", "\n", "\r\n", "'", '"', "\\", "[", "]", "{", "}",
    ",", "&x", "*x", "&y", "*y", "!!str", "!!int", "!!binary", "!!python/object", "!t", "?", "? ",
    "#", "---", "...", "|", ">", "%YAML 1.1", "%TAG", "@", "`", "\x00", "\u2028", "\ufeff", "é",
]

yamlish_text = st.lists(
    st.one_of(st.sampled_from(YAMLISH_TOKENS), st.text(max_size=3)), max_size=40
).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(), yamlish_text), fmt=st.sampled_from(["yaml", "json"]))
def test_any_text_raises_only_config_error(text, fmt):
    try:
        doc = load_text(text, "fuzz", format=fmt)
    except ConfigError:
        return
    assert isinstance(doc.data, dict)


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=False),
    st.text(max_size=20),
)
keys = st.text(max_size=10)
values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4), st.dictionaries(keys, children, max_size=4)),
    max_leaves=20,
)
configs = st.dictionaries(keys, values, max_size=6)


def _paths(data, prefix=()):
    if isinstance(data, dict):
        items = data.items()
    elif isinstance(data, list):
        items = enumerate(data)
    else:
        return
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


def _same(a, b):
    """Equality where -0.0 == 0.0 is not enough: types must match too (True is not 1)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@settings(max_examples=150, deadline=None)
@given(data=configs)
def test_yaml_round_trip(data):
    text = yaml.safe_dump(data, sort_keys=False)
    doc = load_text(text, "rt.yaml")
    assert _same(doc.data, data)
    assert all(path in doc.marks for path in _paths(data))


@settings(max_examples=150, deadline=None)
@given(data=configs)
def test_json_round_trip(data):
    doc = load_text(json.dumps(data, indent=1), "rt", format="json")
    assert _same(doc.data, data)
    assert doc.raw_scalars == {}
