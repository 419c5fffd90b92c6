"""Elastic-world training script: argv OUT PROJECT STEPS SLEEP. Saves after every optimizer
step; on a restart (or with a checkpoint in PROJECT) resumes from the latest commit with
``allow_world_size_change=True`` — the documented opt-in. Rank 0 writes the final parameters
and the checkpoint it resumed from (if any) into OUT."""

import sys
import time
from pathlib import Path

import torch
from _ready import announce
from torchrig import Accelerator
from torchrig.config.options import ProjectConfiguration
from torchrig.testing.runs import StepCounter

out = announce()
project, steps, pause = Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
torch.manual_seed(0)
accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=str(project), automatic_checkpoint_naming=True))
model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.utils.data.TensorDataset(torch.linspace(-1, 1, 256).unsqueeze(1).repeat(1, 4), torch.arange(256) % 2)
loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
count = StepCounter()
accelerator.register_for_checkpointing(count)
resumed = None
if (project / "checkpoints").is_dir() and any((project / "checkpoints").iterdir()):
    resumed = Path(accelerator.load_state(allow_world_size_change=True)).name
print(f"world={accelerator.num_processes} resumed={resumed} step={count.step}", flush=True)
while count.step < steps:
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        count.step += 1
        accelerator.save_state()
        time.sleep(pause)
        if count.step >= steps:
            break
if accelerator.is_main_process:
    torch.save({k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
               out / "final.pt")
    (out / "resumed.txt").write_text(str(resumed))
