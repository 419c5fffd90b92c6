"""An Accelerate-style training script (only the import changed) run by `torchrig launch` under the
configuration the test gives (deepspeed in plugins/deepspeed/tests/test_deepspeed.py): accumulate, clip_grad_norm_,
gather_for_metrics, save_state/load_state, save_model. Reports per rank. Arguments: OUT."""

import json
import os
import pathlib
import sys

import torch
from torchrig import Accelerator

out = pathlib.Path(sys.argv[1])
(out / f"ready-{os.environ.get('RANK', '0')}").write_text(str(os.getpid()))  # this worker, for the test
accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
generator = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator))
train = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
evaluation = torch.utils.data.DataLoader(data, batch_size=5)
model, optimizer, train, evaluation = accelerator.prepare(model, optimizer, train, evaluation)
losses, steps = [], 0
for x, y in train:
    with accelerator.accumulate(model):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            steps += 1
        optimizer.step()
        optimizer.zero_grad()
    losses.append(float(loss.detach()))
checkpoint = accelerator.save_state(str(out / "checkpoint"))
trained = [p.detach().clone() for p in model.parameters()]
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
accelerator.load_state(checkpoint)
resumed = all(torch.equal(a, b) for a, b in zip(trained, model.parameters()))
seen = 0
model.eval()
with torch.no_grad():
    for x, y in evaluation:
        seen += accelerator.gather_for_metrics(model(x).argmax(-1)).numel()
accelerator.save_model(model, str(out / "weights"))
engine = model
report = {"strategy": accelerator.strategy, "world": accelerator.num_processes, "engine": type(engine).__name__,
          "zero_stage": engine.zero_optimization_stage(), "accumulation": accelerator.gradient_accumulation_steps,
          "engine_accumulation": engine.gradient_accumulation_steps(), "micro_batch": engine.train_micro_batch_size_per_gpu(),
          "clipping": engine.gradient_clipping(), "optimizer_steps": steps, "engine_steps": engine.global_steps,
          "losses": losses, "resumed": resumed, "evaluated": seen, "ds_accelerator": os.environ.get("DS_ACCELERATOR"),
          "pid": os.getpid()}
(out / f"report-{accelerator.process_index}.json").write_text(json.dumps(report))
