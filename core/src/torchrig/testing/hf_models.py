"""Tiny transformers models of several families, built from config objects (no network): same seed -> same
weights in every process; and the random token data they train on. Tensor parallel from a model's own plan,
Hugging Face weights in and out, pipeline and MoE checkpoints use them (the fsdp and deepspeed plugins' tests and
the core's). Needs ``transformers``; the pure-torch models are in :mod:`torchrig.testing.models`."""

from __future__ import annotations

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


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class RareStylesLM(torch.nn.Module):
    """A model declaring, as transformers models do, a ``_tp_plan`` with the styles no tiny model of
    transformers 5.24 uses together: a hidden-split embedding, a fused gate/up projection, a row-wise
    projection fed a whole input, a block computing partial sums on local shards (a parameter entry
    + ``local_params``) summed by ``all_reduce``, a replicated norm, a gathered head."""

    _tp_plan = {
        "embed": "embedding_colwise",
        "norm": "replicate",
        "gate_up": "packed_colwise",
        "down": "rowwise",
        "mix": "rowwise_split_input",
        "block.up": "colwise",
        "block.down.weight": "rowwise",
        "block.down": "local_params",
        "block": "all_reduce",
        "head": "colwise_rep",
    }

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.gate_up = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN)
        self.mix = torch.nn.Linear(HIDDEN, HIDDEN)
        self.block = _Block()
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.norm(self.embed(tokens))
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        h = h + self.down(torch.nn.functional.silu(gate) * up)
        h = h + self.mix(h)
        h = h + self.block(h)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(0, 1))


def build_rare(seed=0):
    torch.manual_seed(seed)
    return RareStylesLM()
