"""The issue's first try, as a user writes it: a 2-layer transformers ``LlamaForCausalLM`` from a
``LlamaConfig``, ``ParallelismConfig(tp_size=2)``, no plan given (the model's own applies), trained a
few steps under ``torchrig launch --strategy fsdp`` (plugins/fsdp/tests/test_hf_plans.py). Rank 0
writes the losses and every parameter gathered with full_tensor(). Arguments: OUT FAMILY STEPS."""

import pathlib
import sys

import torch
from torchrig import Accelerator, ParallelismConfig
from torchrig.testing.hf_models import build, make_data

out, family, steps = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
accelerator = Accelerator(parallelism_config=ParallelismConfig(tp_size=2))
model = build(family)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
loader = torch.utils.data.DataLoader(make_data(steps * 2), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
for (tokens,) in loader:
    loss = model(input_ids=tokens, labels=tokens).loss
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(float(loss.detach()))
params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
          for name, p in accelerator.unwrap_model(model).named_parameters()}
if accelerator.is_main_process:
    torch.save({"losses": losses, "params": params}, out / "result.pt")
accelerator.end_training()
