"""Tiny transformers models of several families, built from config objects (no network), for the tests
of tensor parallel from a model's own plan (plugins/fsdp/tests/test_hf_plans.py): same seed -> same
weights in every process; and the random token data they train on."""

import torch
import transformers

VOCAB, HIDDEN, SEQ = 128, 32, 8
_COMMON = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4}

#: family -> (config class, its arguments beyond the common ones). GQA everywhere it exists (4 query
#: heads, 2 key/value heads); Gemma ties its embeddings by default, and a tied Llama is listed too.
#: GPT-2 declares no tensor-parallel plan in transformers 5.24, so GPT-NeoX stands for that family.
FAMILIES = {
    "llama": (transformers.LlamaConfig, {"num_key_value_heads": 2}),
    "llama_tied": (transformers.LlamaConfig, {"num_key_value_heads": 2, "tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, {"num_key_value_heads": 2, "head_dim": 8}),
    "gemma": (transformers.GemmaConfig, {"num_key_value_heads": 2, "head_dim": 8}),
    "gpt_neox": (transformers.GPTNeoXConfig, {"attention_dropout": 0.0, "hidden_dropout": 0.0}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 32,
                                                "num_experts": 4, "num_experts_per_tok": 2}),
}


def config(family, **overrides):
    config_class, arguments = FAMILIES[family]
    return config_class(**{**_COMMON, **arguments, **overrides})


def build(family, seed=0, **overrides):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(family, **overrides), attn_implementation="sdpa")


def make_data(samples, seed=1234):
    generator = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (samples, SEQ), generator=generator))
