"""An Accelerator script under --strategy ddp: each rank records what it sees."""

import torch
from _ready import announce
from torchrig import Accelerator

out = announce()
accelerator = Accelerator()
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
accelerator.backward(model(torch.ones(4, 2, device=accelerator.device)).sum())
optimizer.step()
(out / f"rank{accelerator.process_index}.txt").write_text(
    f"{accelerator.process_index} {accelerator.num_processes} {type(model).__name__}")
