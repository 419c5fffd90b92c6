"""A worker for tests/builtins/test_adopted_and_env_clusters.py, started by the test (no launcher) or by torchrun.

``worker.py plain OUT``: an Accelerator script that lets torchrig find its place from the
environment (a PyTorchJob pod: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; or torchrun's set).

``worker.py adopt OUT STORE RANK WORLD``: the script creates the default process group itself
(``dist.init_process_group`` on a FileStore, no environment variables) before ``Accelerator()``;
first two mismatching configurations must be refused, then the group is adopted.

Each rank writes what it saw to ``OUT/rank-<rank>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torchrig import Accelerator, InitProcessGroupKwargs
from torchrig.distributed.process_group import ADOPTED_GROUP, release_groups_at_exit
from torchrig.errors import ConfigError


def train_one_step(accelerator: Accelerator) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    rank = accelerator.process_index
    loss = model(torch.full((8, 4), float(rank + 1))).pow(2).mean()  # different data per rank
    accelerator.backward(loss)
    optimizer.step()
    return {
        "rank": rank, "num_processes": accelerator.num_processes, "local_rank": accelerator.local_process_index,
        "source": accelerator._run.cluster.source, "distributed_type": accelerator.distributed_type.value,
        "reduced": accelerator.reduce(torch.tensor([float(rank + 1)]), "sum").item(),
        "weights": [round(v, 6) for v in accelerator.unwrap_model(model).weight.detach().flatten().tolist()],
    }


def refused(**kwargs) -> str:
    try:
        Accelerator(cpu=True, **kwargs)
    except ConfigError as exc:
        return str(exc)
    return "not refused"


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    seen: dict = {}
    if mode == "adopt":
        store, rank, world = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
        group = dist.group.WORLD
        os.environ["TORCHRIG_NUM_PROCESSES"] = "3"
        seen["num_processes_mismatch"] = refused()
        del os.environ["TORCHRIG_NUM_PROCESSES"]
        seen["backend_mismatch"] = refused(kwargs_handlers=[InitProcessGroupKwargs(backend="nccl")])
        calls = []
        original = dist.init_process_group
        dist.init_process_group = lambda *a, **k: calls.append(k) or original(*a, **k)
        try:
            accelerator = Accelerator(cpu=True)
        finally:
            dist.init_process_group = original
        adopted = accelerator._run.stash.get(ADOPTED_GROUP)
        seen |= {"init_calls": len(calls), "same_group": dist.group.WORLD is group,
                 "adopted_group": adopted is not None and adopted.group is group,
                 "adopted_backend": adopted.backend if adopted else None}
    else:
        seen["environ"] = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
        accelerator = Accelerator(cpu=True)
    seen |= train_one_step(accelerator)
    accelerator.wait_for_everyone()
    if mode == "adopt":
        dist.destroy_process_group()  # the script's own group: the script destroys it
    else:  # torchrig created the group: what its exit handler does, observed (it runs again at exit)
        release_groups_at_exit()
        seen["initialized_after_release"] = dist.is_initialized()
    with open(os.path.join(out, f"rank-{seen['rank']}.json"), "w") as handle:
        json.dump(seen, handle)


if __name__ == "__main__":
    main()
