"""A notebook cell as a user writes it: a training function launched with notebook_launcher.

argv: OUT MODE, MODE in {train, fail, debug, twice}. Each worker writes ``pid-<rank>`` first so the
test can check by pid that none survives, then (train/debug) ``params-<rank>.pt`` after training.
"""

import os
import sys
from pathlib import Path

import torch
from torchrig import Accelerator
from torchrig.launchers import debug_launcher, notebook_launcher


def train(out: str, fail_rank: int = -1) -> None:
    out_dir = Path(out)
    rank = int(os.environ["RANK"])
    (out_dir / f"pid-{rank}").write_text(str(os.getpid()))
    if rank == fail_rank:
        raise RuntimeError(f"boom on rank {rank}")
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(1234 + accelerator.process_index)  # different init per rank: prepare must sync it
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)  # different data per rank
    for _ in range(3):
        x = torch.randn(8, 4, generator=generator)
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    state = {name: p.detach().clone() for name, p in accelerator.unwrap_model(model).named_parameters()}
    torch.save({"state": state, "world": accelerator.num_processes, "fork": accelerator.state.fork_launched,
                "type": str(accelerator.distributed_type)}, out_dir / f"params-{rank}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    out, mode = sys.argv[1], sys.argv[2]
    port = sys.argv[3] if len(sys.argv) > 3 else "29500"
    if mode == "train":
        notebook_launcher(train, args=(out,), num_processes=2, use_port=port)
    elif mode == "fail":
        notebook_launcher(train, args=(out, 1), num_processes=2, use_port=port)
    elif mode == "debug":
        debug_launcher(train, args=(out,), num_processes=2)
    elif mode == "twice":
        accelerator = Accelerator(cpu=True)
        notebook_launcher(train, args=(out,), num_processes=2, use_port=port)
