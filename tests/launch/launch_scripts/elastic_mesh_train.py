"""Elastic N-D training script (fsdp strategy, tensor parallel over 2 ranks): argv OUT PROJECT STEPS
SLEEP [FULL_WORLD]. The mesh sizes come from the launch flags (``--tp_size 2 --dp_shard_size 2``, or ``--tp_size 2``
alone for the reference); each rank keeps its batch of 2 samples. Saves after every optimizer step
(sleeping SLEEP seconds in the first attempt only, so a kill lands mid-run); on a restart (or with a
checkpoint in PROJECT) resumes from the latest commit with ``allow_world_size_change=True``. Rank 0
writes the gathered final parameters, the checkpoint it resumed from, the mesh it ran on and the
index of the first sample it trained on after resuming into OUT. FULL_WORLD: a first round with fewer
ranks (a machine joined after the round closed) trains nothing: it commits a step-0 checkpoint, so
the launcher grows the world at once, and waits to be restarted into it (every step then runs on
the full mesh, whatever the join order)."""

import json
import os
import sys
import time
from pathlib import Path

import torch
from _ready import announce
from torchrig import Accelerator
from torchrig.config.options import ProjectConfiguration
from torchrig.testing.runs import StepCounter


def full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).clone()


out = announce()
project, steps = Path(sys.argv[2]), int(sys.argv[3])
pause = float(sys.argv[4]) if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" else 0.0
torch.manual_seed(0)
accelerator = Accelerator(cpu=True, parallelism_config={"tp_plan": {"0": "colwise", "2": "rowwise"}},
                          project_config=ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True))
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
index = torch.arange(256)
data = torch.utils.data.TensorDataset(torch.linspace(-1, 1, 256).unsqueeze(1).repeat(1, 4), index % 2, index)
loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
count = StepCounter()
accelerator.register_for_checkpointing(count)
resumed = None
if (project / "checkpoints").is_dir() and any((project / "checkpoints").iterdir()):
    resumed = Path(accelerator.load_state(allow_world_size_change=True)).name
elif accelerator.num_processes < (int(sys.argv[5]) if len(sys.argv) > 5 else 0):
    accelerator.save_state()
    time.sleep(120)  # stopped by the launcher, which grows the world after this commit
    sys.exit(f"the launcher did not grow the world to {sys.argv[5]} ranks after the step-0 commit")
resumed_step = count.step
mesh = accelerator.torch_device_mesh
first_sample = None
while count.step < steps:
    for x, y, sample in loader:
        if first_sample is None:
            first_sample = int(sample[0])
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        count.step += 1
        accelerator.save_state()
        time.sleep(pause)
        if count.step >= steps:
            break
params = {name: full(p) for name, p in accelerator.unwrap_model(model).named_parameters()}
if accelerator.is_main_process:
    torch.save(params, out / "final.pt")
    layout = {"world": accelerator.num_processes, "resumed": resumed, "resumed_step": resumed_step,
              "first_sample": first_sample,
              "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)) if mesh is not None else None}
    (out / "run.json").write_text(json.dumps(layout))
