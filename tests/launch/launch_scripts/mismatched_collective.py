"""Rank 3 (the last rank) calls all_reduce where the others call all_gather (the same sequence
number, 2): every rank times out after 3 s, and the launcher names both collectives and both
lines. ``argv[2]``: the backend, ``gloo`` (CPU) or ``nccl`` (one GPU a rank)."""

import datetime
import os
import sys

import torch
import torch.distributed as dist
from _ready import announce

announce()
backend = sys.argv[2] if len(sys.argv) > 2 else "gloo"
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if backend == "nccl" else torch.device("cpu")
dist.init_process_group(backend, timeout=datetime.timedelta(seconds=3), device_id=device if backend == "nccl" else None)
tensor = torch.ones(4, device=device)
dist.all_reduce(tensor)  # collective #1, on every rank
if dist.get_rank() == dist.get_world_size() - 1:
    dist.all_reduce(tensor)  # the mismatch: the last rank's collective #2
else:
    dist.all_gather([torch.empty(4, device=device) for _ in range(dist.get_world_size())], tensor)
if backend == "nccl":
    torch.cuda.synchronize()  # NCCL's collectives are asynchronous: the timeout surfaces here or in its watchdog
