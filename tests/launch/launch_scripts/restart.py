"""Attempt 0: rank 1 fails once (a marker file remembers it); attempt 1 succeeds. Each attempt
records the master port it used and runs gloo collectives, which is what failed to reconnect
with torchrun's shared store."""

import os

import torch
import torch.distributed as dist
from _ready import announce

out = announce()
dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
(out / f"attempt{attempt}-rank{dist.get_rank()}.txt").write_text(f"{value.item():g} {os.environ['MASTER_PORT']}")
marker = out / "failed-once"
if dist.get_rank() == 1 and not marker.exists():
    marker.write_text("x")
    raise RuntimeError("first attempt fails on purpose")
dist.barrier()
dist.destroy_process_group()
