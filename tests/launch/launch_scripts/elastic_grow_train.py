"""Elastic growth script: argv OUT PROJECT STEPS. Before it has resumed from a checkpoint (the first
round, alone), it trains slowly, commits a checkpoint after the first step and then only once the
file OUT/commit exists (the test creates it after a second machine has started waiting to join);
once resumed (the grown round), it trains the rest of STEPS without pause or saves. Rank 0 writes
the world size, the checkpoint it resumed from and the step it stopped at into OUT/run.json."""

import json
import sys
import time
from pathlib import Path

import torch
from _ready import announce
from torchrig import Accelerator
from torchrig.config.options import ProjectConfiguration
from torchrig.testing.runs import StepCounter

out = announce()
project, steps = Path(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
accelerator = Accelerator(cpu=True, project_config=ProjectConfiguration(
    project_dir=str(project), automatic_checkpoint_naming=True))
model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.utils.data.TensorDataset(torch.linspace(-1, 1, 256).unsqueeze(1).repeat(1, 4), torch.arange(256) % 2)
loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
count = StepCounter()
accelerator.register_for_checkpointing(count)
resumed = None
if (project / "checkpoints").is_dir() and any((project / "checkpoints").iterdir()):
    resumed = Path(accelerator.load_state(allow_world_size_change=True)).name
requested = False
while count.step < steps:
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        count.step += 1
        if resumed is None:  # the first round: alone, slow, committing on request
            if count.step == 1 or (not requested and (out / "commit").exists()):
                requested = count.step > 1
                accelerator.save_state()
            time.sleep(0.1)
        if count.step >= steps:
            break
if accelerator.is_main_process:
    (out / "run.json").write_text(json.dumps({"world": accelerator.num_processes, "resumed": resumed,
                                              "step": count.step}))
