"""Train a tiny transformer under whatever the launch configures (fsdp in plugins/fsdp/tests/test_fsdp.py), save
a checkpoint and full weights, and report per rank. Arguments: OUT [STEPS]."""

import json
import os
import pathlib
import sys

import torch
from torchrig import Accelerator


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mix = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + self.mix(torch.tanh(self.norm(x)))


class MixerStack(torch.nn.Module):
    """Not torchrig.testing.models.TinyTransformer: its blocks mix with one Linear, and the loss this run reports
    (which the test expects to fall in three steps) was measured with this network."""

    _no_split_modules = ["Block"]  # as Hugging Face models declare their repeated blocks

    def __init__(self, width=16, depth=2):
        super().__init__()
        self.embed = torch.nn.Linear(6, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


out = pathlib.Path(sys.argv[1])  # announce this worker (its pid) for the test
(out / f"ready-{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
accelerator = Accelerator()
torch.manual_seed(0)
model = MixerStack()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
model, optimizer = accelerator.prepare(model, optimizer)
generator = torch.Generator().manual_seed(accelerator.process_index)
losses = []
for _ in range(steps):
    x, y = torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    loss = torch.nn.functional.cross_entropy(model(x.to(accelerator.device)), y.to(accelerator.device))
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(float(loss.detach()))
accelerator.save_state(str(out / "checkpoint"))
accelerator.save_model(model, str(out / "weights"))
first = next(model.parameters())
report = {"strategy": accelerator.strategy, "world": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision,
          "param_type": type(first).__name__, "device": str(first.device), "losses": losses,
          "sharding": accelerator.config["fsdp_config.sharding_strategy"], "pid": os.getpid()}
(out / f"report-{accelerator.process_index}.json").write_text(json.dumps(report))
