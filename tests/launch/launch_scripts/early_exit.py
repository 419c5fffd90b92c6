"""After a barrier, rank 1 returns (exit code 0) while rank 0 waits in the next barrier, which
then fails: rank 1, which left the job early, is the cause."""

import torch.distributed as dist
from _ready import announce

announce()
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 1:
    raise SystemExit(0)
dist.barrier()
