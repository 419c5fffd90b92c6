"""Train the pipeline LM under whatever mesh the launch configures (plugins/fsdp/tests/test_pipeline.py): the
loss comes from the schedule (``model(tokens, target=labels)``, the default cross-entropy); each rank writes its
stage's parameters gathered with full_tensor() and a report; then save_model and save_state. Arguments: OUT."""

import json
import os
import pathlib
import sys

import torch
from torchrig import Accelerator
from torchrig.testing.models import PipeLM, lm_data

out = pathlib.Path(sys.argv[1])
accelerator = Accelerator()
torch.manual_seed(0)
model = PipeLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
caps = accelerator.strategy_capabilities
per_rank, steps, micro = 4, 2, accelerator.gradient_accumulation_steps
loader = torch.utils.data.DataLoader(lm_data(steps * micro * per_rank * caps.data_parallel_size), batch_size=per_rank)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
for tokens, labels in loader:
    with accelerator.accumulate(model):
        loss = model(tokens, target=labels)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
    losses.append(loss.item())
params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
          for name, p in accelerator.unwrap_model(model).named_parameters()}
torch.save(params, out / f"params-{accelerator.process_index}.pt")
accelerator.save_model(model, str(out / "weights"))  # the stages' shards joined into one file
accelerator.save_state(str(out / "checkpoint"))
mesh = accelerator.torch_device_mesh
report = {"mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)), "losses": losses, "pid": os.getpid(),
          "dp": [caps.data_parallel_size, caps.data_parallel_rank]}
(out / f"report-{accelerator.process_index}.json").write_text(json.dumps(report))
