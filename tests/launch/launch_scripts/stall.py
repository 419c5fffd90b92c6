"""Rank 1 stalls outside any collective; rank 0 times out in a barrier after 3 s."""

import datetime
import time

import torch.distributed as dist
from _ready import announce

announce()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
dist.barrier()
if dist.get_rank() == 1:
    time.sleep(600)  # the stall: never reaches the barrier below
dist.barrier()
