"""A tiny language model for the mesh tests (plugins/fsdp/tests/test_mesh.py): an embedding, two blocks of
attention + MLP, a head; the forward computes the loss (so it runs under ``loss_parallel``), and the plans
that split it over a ``tp`` axis, with and without sequence parallel."""

import torch

VOCAB, DIM, HEADS, SEQ = 32, 32, 4, 8

TP_PLAN = {
    "embed": "embedding",
    "blocks.*.attn.[qkv]": "colwise",
    "blocks.*.attn.o": "rowwise",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
    "head": "output",
}
TP_SP_PLAN = {
    "embed": "embedding_sp",
    "blocks.*.norm[12]": "sequence_parallel",
    "blocks.*.attn": "prepare_input_sp",
    "blocks.*.attn.[qkv]": "colwise",
    "blocks.*.attn.o": "rowwise_sp",
    "blocks.*.mlp": "prepare_input_sp",
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise_sp",
    "norm": "sequence_parallel",
    "head": "output_sp",
}


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape
        head = DIM // HEADS  # local heads under tensor parallel: -1 below
        q, k, v = (proj(x).view(batch, seq, -1, head).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(DIM, 2 * DIM)
        self.down = torch.nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, labels):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))


def make_data(samples, seed=1234):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, SEQ + 1), generator=generator)
    return torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
