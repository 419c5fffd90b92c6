"""Tensor parallel on a tiny transformer — the script of docs/parallelism.md.

The model declares its own tensor-parallel plan (``_tp_plan``, as transformers' models do), so flags
alone turn tensor parallelism on; the same script runs unsplit in one process:

    python examples/train_tp.py
    torchrig launch --use_fsdp --num_processes 2 --cpu --tp_size 2 examples/train_tp.py

Its module names are those of the ``tp_plan`` in docs/parallelism.md, so that config file works too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchrig import Accelerator, ProjectConfiguration
from torchrig.utils import set_seed

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 16


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallel each rank holds HEADS / tp_size of them (colwise wq, wk, wv)
        q, k, v = (w(x).view(batch, seq, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))  # rowwise: the partial sums all-reduced


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TinyTransformer(nn.Module):
    #: module-name glob -> style; used when tp_size > 1 and no parallelism_config.tp_plan is given
    _tp_plan = {
        "embed": "embedding",
        "layers.*.attention.w[qkv]": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w[13]": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "output": "output",
    }

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def main() -> None:
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir="tp_run",
                                                                  automatic_checkpoint_naming=True))
    set_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, VOCAB, (64, SEQ + 1), generator=torch.Generator().manual_seed(0))
    # the task: predict the next token of sequences that repeat their first half
    tokens[:, SEQ // 2 + 1:] = tokens[:, 1:SEQ // 2 + 1]
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(2):
        correct = torch.zeros((), device=accelerator.device)
        for inputs, labels in loader:
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            correct += (logits.argmax(-1) == labels).sum()
        correct = accelerator.reduce(correct, "sum", over="data")  # each sample counted once under TP
        accelerator.print(f"epoch {epoch}: loss {loss.item():.3f}, {int(correct)} tokens right of "
                          f"{len(tokens) * SEQ}, mesh {accelerator.torch_device_mesh}")
    accelerator.save_state()  # tp_run/checkpoints/checkpoint_0: reshardable to any other layout
    accelerator.end_training()


if __name__ == "__main__":
    main()
