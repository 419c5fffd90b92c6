"""Asynchronous saves of sharded state (issue 38): ``save_state(async_save=True)`` under FSDP2 stages each
DCP state dict's local shards on the CPU when it is called and writes them in the save's background half,
inside the commit protocol — the checkpoint holds the state of the call (not what training changed after
it), loads bit-equal, and a rank killed while the background half runs leaves the previous checkpoint the
latest, bit-equal."""

from __future__ import annotations

import os

import pytest
import torch
from torchrig.checkpoint import layout
from torchrig.checkpoint.faults import FAULT_ENV
from torchrig.testing.contracts import rank_environment
from torchrig.testing.models import TinyTransformer
from torchrig.testing.pool import WorkerDied, checked_pool

TIMEOUT = 120

pytestmark = pytest.mark.multiprocess


def _run(root: str):
    from torchrig import Accelerator
    from torchrig.config.options import ProjectConfiguration
    from torchrig_fsdp.options import FullyShardedDataParallelPlugin

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, strategy="fsdp",
                              fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"),
                              project_config=ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True))
    model = TinyTransformer()
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model, optimizer


def _step(accelerator, model, optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed * 10 + accelerator.process_index)
    inputs = torch.randn(4, 6, generator=generator)
    accelerator.backward(model(inputs).pow(2).mean())
    optimizer.step()
    optimizer.zero_grad()


def _local(model) -> dict[str, torch.Tensor]:
    return {name: parameter.to_local().detach().clone() for name, parameter in model.named_parameters()}


def _optimizer(optimizer) -> dict[str, torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)
    return {f"{i}.{key}": (value.to_local() if hasattr(value, "to_local") else value).detach().clone()
            for i, state in enumerate(inner.state.values()) for key, value in state.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _save_then_train(ctx, root: str, fault: str | None):
    """Save #1 async, train on while it commits; save #2 async (``fault``: a rank is killed in its
    background half); what each save was called with, and whether training moved the weights."""
    import threading

    from torchrig_fsdp import checkpoint

    writes_on: list[str] = []  # the thread each DCP write ran on: the effect check of "async"
    write = checkpoint._dcp_write

    def observed(*args):
        writes_on.append("main" if threading.current_thread() is threading.main_thread() else "background")
        return write(*args)

    checkpoint._dcp_write = observed
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, optimizer = _run(root)
        _step(accelerator, model, optimizer, 0)
        at_save = (_local(model), _optimizer(optimizer))
        first = accelerator.save_state(async_save=True)
        _step(accelerator, model, optimizer, 1)  # changes every shard while the save may still be writing
        moved = not _same(_local(model), at_save[0])
        accelerator._wait_for_checkpoint()
        checkpoint._dcp_write = write
        if fault is not None:
            os.environ[FAULT_ENV] = fault
        accelerator.save_state(async_save=True)
        accelerator._wait_for_checkpoint()
        accelerator.end_training()
        return {"first": os.path.basename(first), "at_save": at_save, "moved": moved, "writes_on": writes_on}


def _load(ctx, root: str):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, optimizer = _run(root)
        directory = accelerator.load_state()
        loaded = (_local(model), _optimizer(optimizer))
        accelerator.end_training()
        return {"loaded_from": os.path.basename(directory), "loaded": loaded}


@pytest.fixture(scope="module")
def pool():
    """Two ranks, one of which may be killed on purpose (the survivor gets one second)."""
    with checked_pool(2, error_grace=1.0) as workers:
        yield workers


def test_an_async_sharded_save_holds_the_state_of_the_call_and_a_kill_in_its_background_half_loses_nothing(
        pool, tmp_path):
    root = str(tmp_path)
    with pytest.raises(WorkerDied, match="rank 0"):
        pool.run(_save_then_train, root, "before_manifest@0", timeout=TIMEOUT)
    # rank 0 died in the second save's background half, its files written and agreed, the manifest not: checkpoint_0 stays the latest, nothing half-written is kept
    checkpoints = os.path.join(root, "checkpoints")
    assert layout.latest_checkpoint(checkpoints) == os.path.join(checkpoints, "checkpoint_0")
    saved_shards = sorted(name for name in os.listdir(os.path.join(checkpoints, "checkpoint_0")) if "fsdp" in name
                          or name.startswith("optimizer"))
    assert saved_shards == ["optimizer_0", "pytorch_model_fsdp_0"]  # DCP directories, every rank's shards
    results = pool.run(_load, root, timeout=TIMEOUT)
    reference = pool.run(_save_then_train, str(tmp_path / "again"), None, timeout=TIMEOUT)
    for rank, (loaded, made) in enumerate(zip(results, reference)):
        assert made["moved"], "training after the call changed nothing: the test would not tell a late copy"
        assert made["writes_on"] == ["background", "background"], "the model's and optimizer's DCP writes"
        assert loaded["loaded_from"] == "checkpoint_0"
        # bit-equal to the state at the call, though training changed it before the files were written
        assert _same(loaded["loaded"][0], made["at_save"][0]), f"rank {rank}: parameters"
        assert _same(loaded["loaded"][1], made["at_save"][1]), f"rank {rank}: optimizer state"
