"""ProbedLM, a tiny Llama-style transformer for the fp8 tests: every projection an ``nn.Linear`` (so the
conversion has real work), feature counts multiples of 16, and one 32x10 probe head that the
default filter must skip."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 64
DIM = 32


class Block(nn.Module):
    def __init__(self, dim: int = DIM, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        attn = nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                          is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.down(torch.relu(self.up(self.norm2(x))))


class ProbedLM(nn.Module):
    """2 blocks x 4 Linear layers + the LM head (9 convertible) + a 32x10 probe (skipped by default)."""

    _no_split_modules = ["Block"]

    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB)
        self.probe = nn.Linear(DIM, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x) + 0 * self.probe(x).sum()


def batches(steps: int, batch: int = 8, seq: int = 16, seed: int = 1) -> list[torch.Tensor]:
    """A learnable sequence task: each token is the previous plus one (mod VOCAB)."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (steps, batch, 1), generator=generator)
    return [(start + torch.arange(seq + 1)) % VOCAB for start in starts]


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
