"""``save_model`` writes what transformers' ``from_pretrained`` reads, and
``load_pretrained_weights`` reads what ``save_pretrained`` writes — in one process (the sharded
layouts are in plugins/fsdp/tests/test_hf_weights_layouts.py and the deepspeed plugin's tests).

Tiny transformers models built from configs (no network); every comparison is bit-exact
(``torch.equal``), against files read back from disk.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open
from torchrig.testing.hf_models import build


def _file_keys(directory: str) -> set[str]:
    keys: set[str] = set()
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as handle:
                keys |= set(handle.keys())
    return keys


def _accelerator():
    from torchrig import Accelerator

    return Accelerator(cpu=True)


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_save_model_output_loads_with_from_pretrained_bit_exactly(tmp_path, family):
    reference = build(family, seed=3)
    reference.save_pretrained(tmp_path / "reference")
    accelerator = _accelerator()
    prepared = accelerator.prepare(build(family, seed=3))
    accelerator.save_model(prepared, tmp_path / "saved", max_shard_size="20KB")
    assert (tmp_path / "saved" / "config.json").exists()
    assert json.loads((tmp_path / "saved" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert _file_keys(str(tmp_path / "saved")) == _file_keys(str(tmp_path / "reference"))
    index = json.loads((tmp_path / "saved" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == _file_keys(str(tmp_path / "saved"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert (loaded.lm_head.weight is loaded.get_input_embeddings().weight) == (family == "llama_tied")
    expected = dict(reference.named_parameters())
    got = dict(loaded.named_parameters())
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def test_save_model_of_a_compiled_model_drops_the_wrapper_segment(tmp_path):
    accelerator = _accelerator()
    model = build("llama", seed=1)
    compiled = torch.compile(model)
    accelerator.save_model(compiled, tmp_path / "saved")
    assert _file_keys(str(tmp_path / "saved")) == set(model.state_dict())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_save_model_of_a_peft_model_writes_the_adapter_alone(tmp_path):
    peft = pytest.importorskip("peft")
    accelerator = _accelerator()
    base = build("llama", seed=2)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    prepared = accelerator.prepare(lora)
    written = accelerator.save_model(prepared, tmp_path / "adapter")
    assert set(os.listdir(tmp_path / "adapter")) >= {"adapter_model.safetensors", "adapter_config.json"}
    assert "adapter_model.safetensors" in written and "adapter_config.json" in written
    assert not (tmp_path / "adapter" / "model.safetensors").exists()
    keys = _file_keys(str(tmp_path / "adapter"))
    assert keys and all("lora_" in key for key in keys), sorted(keys)
    expected = peft.get_peft_model_state_dict(lora)
    assert keys == set(expected)
    fresh = peft.PeftModel.from_pretrained(build("llama", seed=2), tmp_path / "adapter")
    mine = dict(lora.named_parameters())
    for name, value in fresh.named_parameters():
        assert torch.equal(value, mine[name]), name


# -- weights in ---------------------------------------------------------------------------------


def _assert_same_parameters(model, reference, dtype=None):
    expected = dict(reference.named_parameters())
    got = dict(model.named_parameters())
    assert set(got) == set(expected)
    for name, value in expected.items():
        value = value.detach() if dtype is None else value.detach().to(dtype)
        assert torch.equal(got[name].detach().to(value.dtype), value), name


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_load_pretrained_weights_reads_save_pretrained_files_into_a_prepared_model(tmp_path, family):
    reference = build(family, seed=5)
    reference.save_pretrained(tmp_path / "ref", max_shard_size="20KB")
    assert (tmp_path / "ref" / "model.safetensors.index.json").exists()
    accelerator = _accelerator()
    prepared = accelerator.prepare(build(family, seed=6))
    result = accelerator.load_pretrained_weights(prepared, tmp_path / "ref")
    model = accelerator.unwrap_model(prepared)
    _assert_same_parameters(model, reference)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == (family == "llama_tied")
    total = sum(t.numel() * t.element_size() for t in {id(p): p for p in reference.parameters()}.values())
    assert result.bytes_read == total and result.missing == () and result.unexpected == ()
    assert result.largest_read == max(p.numel() * p.element_size() for p in reference.parameters())


def test_load_pretrained_weights_converts_the_files_dtype(tmp_path):
    reference = build("llama", seed=7).to(torch.bfloat16)
    reference.save_pretrained(tmp_path / "bf16")
    accelerator = _accelerator()
    model = build("llama", seed=8)
    accelerator.load_pretrained_weights(model, tmp_path / "bf16" / "model.safetensors")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    _assert_same_parameters(model, reference, dtype=torch.float32)


def test_missing_and_unexpected_keys_are_named(tmp_path):
    from safetensors.torch import save_file
    from torchrig.checkpoint.files import CheckpointError

    state = {k: v.clone() for k, v in build("llama", seed=9).state_dict().items()}
    del state["model.norm.weight"]
    state["model.extra.weight"] = torch.zeros(2)
    (tmp_path / "w").mkdir()
    save_file(state, str(tmp_path / "w" / "model.safetensors"))
    accelerator = _accelerator()
    model = build("llama", seed=10)
    with pytest.raises(CheckpointError, match=r"missing.*'model\.norm\.weight'.*unexpected.*'model\.extra\.weight'"):
        accelerator.load_pretrained_weights(model, tmp_path / "w")
    result = accelerator.load_pretrained_weights(model, tmp_path / "w", strict=False)
    assert result.missing == ("model.norm.weight",) and result.unexpected == ("model.extra.weight",)
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, state["model.layers.0.mlp.up_proj.weight"])


def test_a_directory_without_safetensors_weights_is_an_error_naming_it(tmp_path):
    from torchrig.checkpoint.files import CheckpointError

    with pytest.raises(CheckpointError, match=r"neither model\.safetensors\.index\.json nor model\.safetensors"):
        _accelerator().load_pretrained_weights(build("llama"), tmp_path)


def test_a_moe_model_round_trips_through_save_model_and_per_expert_files_are_refused_by_name(tmp_path):
    from torchrig.checkpoint.files import CheckpointError

    accelerator = _accelerator()
    model = build("qwen3_moe", seed=12)
    accelerator.save_model(model, tmp_path / "saved")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    _assert_same_parameters(loaded, model)
    fresh = build("qwen3_moe", seed=13)
    accelerator.load_pretrained_weights(fresh, tmp_path / "saved")
    _assert_same_parameters(fresh, model)
    # save_pretrained stores the experts one by one (transformers converts them on load): named, with the remedy
    model.save_pretrained(tmp_path / "per_expert")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj'.*"
                                              r"'model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight'.*from_pretrained"):
        accelerator.load_pretrained_weights(build("qwen3_moe", seed=13), tmp_path / "per_expert")


def test_bad_weights_paths_and_shapes_are_errors_naming_the_file_or_key(tmp_path):
    from safetensors.torch import save_file
    from torchrig.checkpoint.files import CheckpointError

    accelerator = _accelerator()
    model = build("llama", seed=14)
    with pytest.raises(CheckpointError, match=r"nowhere does not exist"):
        accelerator.load_pretrained_weights(model, tmp_path / "nowhere")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"weights\.bin is not a \.safetensors file"):
        accelerator.load_pretrained_weights(model, tmp_path / "weights.bin")
    build("llama", seed=15).save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    second = sorted(set(index["weight_map"].values()))[1]
    os.unlink(tmp_path / "sharded" / second)
    with pytest.raises(CheckpointError, match=rf"names files that are not there: {second}"):
        accelerator.load_pretrained_weights(model, tmp_path / "sharded")
    state = {k: v.clone() for k, v in build("llama", seed=16).state_dict().items()}
    state["model.norm.weight"] = torch.ones(7)
    (tmp_path / "wrong").mkdir()
    save_file(state, str(tmp_path / "wrong" / "model.safetensors"))
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight': files \(7,\), model \(32,\)"):
        accelerator.load_pretrained_weights(model, tmp_path / "wrong")
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, before), "a refused load changed the model"
