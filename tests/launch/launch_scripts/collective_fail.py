"""After a barrier, rank 1 fails (``exit``: sys.exit(3); ``kill``: SIGKILLs itself) while rank 0
waits in the next barrier, which then fails too: rank 1 is the culprit."""

import os
import signal
import sys

import torch.distributed as dist
from _ready import announce

announce()
how = sys.argv[2]
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    if how == "exit":
        sys.exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
dist.barrier()
