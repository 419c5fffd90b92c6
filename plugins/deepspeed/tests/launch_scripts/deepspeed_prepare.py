"""Prepare one model under the deepspeed strategy and take one step (what starts DeepSpeed's comm
backend, so what JIT-compiles its CPU op the first time): the stalled-compile-lock test runs it."""

import torch
from torchrig import Accelerator

accelerator = Accelerator()
model = torch.nn.Linear(4, 2)
model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
accelerator.backward(model(torch.ones(2, 4)).sum())
optimizer.step()
accelerator.print("prepared and stepped")
