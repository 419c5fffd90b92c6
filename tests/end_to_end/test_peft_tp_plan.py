"""The tensor-parallel plan of a LoRA (peft) model, without processes: ``adapter_tp_plan`` finds the wrapped
model's own plan, puts peft's prefix in front, splits each LoRA layer's ``base_layer`` under the layer's style and
the adapter on the split side with it, and refuses a LoRA layer under a style it cannot follow, naming it.
(FSDP2 x TP training with such a plan: plugins/fsdp/tests/test_fsdp_peft.py.)"""

from __future__ import annotations

import peft
import pytest
import transformers
from torchrig.errors import ConfigError
from torchrig.testing import peft_lora
from torchrig_fsdp.mesh import resolve_plan
from torchrig_fsdp.wrapping import adapter_tp_plan

LAYER = "base_model.model.model.layers.0.self_attn"


def test_the_models_own_plan_follows_its_adapters():
    model = peft_lora.build()
    plan = adapter_tp_plan(model)
    assert plan[f"{LAYER}.q_proj.base_layer"] == plan[f"{LAYER}.q_proj.lora_B.default"] == "colwise"
    assert plan[f"{LAYER}.o_proj.base_layer"] == plan[f"{LAYER}.o_proj.lora_A.default"] == "rowwise"
    assert f"{LAYER}.q_proj.lora_A.default" not in plan and f"{LAYER}.o_proj.lora_B.default" not in plan
    assert plan["base_model.model.model.layers.*.self_attn.k_proj"] == "colwise"  # no adapter: prefixed only
    assert plan["base_model.model.lm_head"] == "colwise_gather_output"
    resolved = resolve_plan(model, plan, False, "plan")  # every entry names a module torch's styles can split
    assert all(type(model.get_submodule(name)).__name__ == "Linear" for name in resolved if "embed" not in name)


def test_a_users_plan_relative_to_the_wrapped_model_is_prefixed_and_followed():
    plan = adapter_tp_plan(peft_lora.build(), {"model.layers.*.self_attn.v_proj": "colwise"})
    assert set(plan) == {f"base_model.model.model.layers.{i}.self_attn.v_proj.{part}"
                         for i in (0, 1) for part in ("base_layer", "lora_B.default")}


def test_a_model_without_adapters_keeps_its_plan():
    model = transformers.LlamaForCausalLM(peft_lora.llama_config())
    assert adapter_tp_plan(model) is None
    assert adapter_tp_plan(model, {"lm_head": "colwise"}) == {"lm_head": "colwise"}


def test_a_lora_embedding_under_the_embedding_style_is_refused_naming_it():
    model = peft.get_peft_model(transformers.LlamaForCausalLM(peft_lora.llama_config()),
                                peft_lora.lora_config(target_modules=["embed_tokens", "q_proj"]))
    with pytest.raises(ConfigError, match=r"'base_model\.model\.model\.embed_tokens' is a LoRA layer \(peft\) under "
                                          r"style 'embedding_rowwise'"):
        adapter_tp_plan(model)
