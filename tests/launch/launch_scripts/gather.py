"""Two ranks agree on rank and world size through a gloo collective."""

import os
import sys

import torch.distributed as dist
from _ready import announce

out = announce()
dist.init_process_group("gloo")
ranks = [None] * dist.get_world_size()
dist.all_gather_object(ranks, int(os.environ["RANK"]))
(out / f"rank{dist.get_rank()}.txt").write_text(
    f"{dist.get_rank()} {dist.get_world_size()} {sorted(ranks)} {os.environ['LOCAL_RANK']} {sys.argv[2:]}")
print(f"hello from rank {dist.get_rank()}", flush=True)
dist.destroy_process_group()
