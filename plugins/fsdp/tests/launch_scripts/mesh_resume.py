"""Train the tiny LM under the mesh the launch configures, resuming from a checkpoint saved under another
mesh when given one (plugins/fsdp/tests/test_mesh_resume.py). Every layout sees global batches of 4.
Arguments: OUT STEPS [RESUME_FROM]; writes OUT/checkpoint, OUT/report-<rank>.json and, on rank 0,
OUT/params.pt (every parameter gathered)."""

import itertools
import json
import logging
import pathlib
import sys

import torch
from torchrig import Accelerator
from torchrig.testing.models import TinyLM, lm_data

out, steps = pathlib.Path(sys.argv[1]), int(sys.argv[2])
resume = sys.argv[3] if len(sys.argv) > 3 else None
messages = []
handler = logging.Handler()
handler.emit = lambda record: messages.append(record.getMessage())
logging.getLogger("torchrig").addHandler(handler)
logging.getLogger("torchrig").setLevel(logging.INFO)

accelerator = Accelerator()
torch.manual_seed(0)
model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
dp = accelerator.strategy_capabilities.data_parallel_size
loader = torch.utils.data.DataLoader(lm_data(8 * 4), batch_size=4 // dp)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
if resume is not None:
    accelerator.load_state(resume)
losses = []
for tokens, labels in itertools.islice(loader, steps):
    loss = model(tokens, labels)
    accelerator.backward(loss)
    accelerator.clip_grad_norm_(model.parameters(), 0.5)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(float(loss.detach()))
accelerator.save_state(str(out / "checkpoint"))
params = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
          for name, p in accelerator.unwrap_model(model).named_parameters()}
if accelerator.is_main_process:
    torch.save(params, out / "params.pt")
mesh = accelerator.torch_device_mesh
report = {"mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)), "losses": losses, "dp": dp, "log": messages}
(out / f"report-{accelerator.process_index}.json").write_text(json.dumps(report))
accelerator.end_training()
