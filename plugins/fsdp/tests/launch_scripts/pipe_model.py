"""A tiny language model for the pipeline tests (plugins/fsdp/tests/test_pipeline.py), written as
torchtitan's models are for pipeline splitting: a stage is the model with other stages' modules
removed, so the forward skips a module that is ``None`` and iterates the layers it still has."""

import torch
from mesh_model import DIM, VOCAB, Block

LAYERS = 4


class PipeLM(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens) if self.embed is not None else tokens
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def lm_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
