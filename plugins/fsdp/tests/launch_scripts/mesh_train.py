"""Train the tiny LM under whatever mesh the launch configures (plugins/fsdp/tests/test_mesh.py) and report
per rank; rank 0 also writes every parameter gathered with full_tensor(); then save_model and save_state. Arguments:
OUT STEPS."""

import json
import os
import pathlib
import sys

import torch
from torchrig import Accelerator
from torchrig.testing.models import TinyLM, lm_data

out, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
accelerator = Accelerator()
torch.manual_seed(0)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
caps = accelerator.strategy_capabilities
micro = accelerator.gradient_accumulation_steps
loader = torch.utils.data.DataLoader(lm_data(steps * micro * 2 * caps.data_parallel_size), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
for tokens, labels in loader:
    with accelerator.accumulate(model):
        loss = model(tokens, labels)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    losses.append(float(loss.detach()))
params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
          for name, p in accelerator.unwrap_model(model).named_parameters()}
if accelerator.is_main_process:
    torch.save(params, out / "params.pt")
accelerator.save_model(model, str(out / "weights"))  # gathered from the 2-D layout into one file
accelerator.save_state(str(out / "checkpoint"))
mesh = accelerator.torch_device_mesh
report = {"mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)), "losses": losses, "pid": os.getpid(),
          "dp": [caps.data_parallel_size, caps.data_parallel_rank]}
(out / f"report-{accelerator.process_index}.json").write_text(json.dumps(report))
