"""Loading a plain checkpoint into a model whose ``state_dict()`` writes keys its ``load_state_dict`` does not read
back (bitsandbytes' 4-bit layers: the quantization state beside the packed weight, as in QLoRA): equal values are
accepted, a differing one or a key the model does not have is refused naming it, a missing key too."""

from __future__ import annotations

import pytest
import torch
from torchrig.checkpoint.state_dicts import load_model_state
from torchrig.testing import peft_lora

pytest.importorskip("bitsandbytes")

ABSMAX = "base_model.model.model.layers.0.self_attn.k_proj.weight.absmax"


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("qlora-base"))
    peft_lora.save_base(directory)
    return peft_lora.build_qlora(directory)


def _state(model) -> dict[str, torch.Tensor]:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def test_the_quantization_state_a_4bit_model_writes_loads_back_when_it_is_the_models_own(qlora):
    state = _state(qlora)
    assert ABSMAX in state
    with pytest.raises(RuntimeError, match="Unexpected key"):  # what plain torch does with it
        qlora.load_state_dict(state)
    adapter = next(key for key in state if "lora_A" in key)
    state[adapter] = state[adapter] + 1
    load_model_state(qlora, state)
    assert torch.equal(qlora.state_dict()[adapter], state[adapter])


@pytest.mark.parametrize("change", ["differs", "unknown", "missing"])
def test_a_differing_unknown_or_missing_key_is_refused_naming_it(qlora, change):
    state = _state(qlora)
    if change == "differs":
        state[ABSMAX] = state[ABSMAX] * 2
        named = ABSMAX
    elif change == "unknown":
        named = "base_model.model.extra.weight"
        state[named] = torch.zeros(1)
    else:
        named = next(key for key in state if "lora_B" in key)
        del state[named]
    with pytest.raises(RuntimeError, match=named.replace(".", r"\.")):
        load_model_state(qlora, state)
