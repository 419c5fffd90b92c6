"""Checkpoint files tampered with between save and load (issue 40, item 15): FSDP's DCP shards and
the core's own files truncated, flipped, swapped between two checkpoints, deleted, or joined by an
extra file are refused naming the file, before any live parameter changes — every case with
hashes (``save_state(hashes=True)``: a plain ``load_state()`` verifies what was recorded), the
ones sizes reveal without. Real saves on a 2-rank gloo pool, real files."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from torchrig import Accelerator
from torchrig.checkpoint import CheckpointError
from torchrig.testing.contracts import rank_environment

RUN_TIMEOUT = 300  # seconds the pooled run may take before the test gives up (not a measurement)
SHARD = "pytorch_model_fsdp_0/__0_0.distcp"
#: case -> whether file sizes alone reveal it (without hashes)
CASES = {"truncated": True, "flipped": False, "swapped": False, "deleted": True, "extra": True,
         "flipped_rng": False, "truncated_optimizer": True}


def tamper(case: str, directory: Path, other: Path) -> str:
    """Damage a copy of a checkpoint as a disk, a bad copy or a person would; returns the file named."""
    if case == "truncated":
        path = directory / SHARD
        path.write_bytes(path.read_bytes()[:-9])
        return SHARD
    if case == "truncated_optimizer":
        name = next(str(p.relative_to(directory)) for p in sorted((directory / "optimizer_0").glob("*.distcp")))
        (directory / name).write_bytes((directory / name).read_bytes()[:-3])
        return name
    if case in ("flipped", "flipped_rng"):
        name = SHARD if case == "flipped" else "random_states_1.pkl"
        data = bytearray((directory / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (directory / name).write_bytes(bytes(data))
        return name
    if case == "swapped":
        shutil.copyfile(other / SHARD, directory / SHARD)
        return SHARD
    if case == "deleted":
        (directory / SHARD).unlink()
        return SHARD
    assert case == "extra"
    (directory / "pytorch_model_fsdp_0" / "__7_0.distcp").write_bytes(b"\0" * 64)
    return "pytorch_model_fsdp_0/__7_0.distcp"


def _tampered_fsdp_loads(ctx, base: str, hashes: bool) -> dict[str, str]:
    with rank_environment(ctx.rank, ctx.world_size):
        import torch.distributed as dist
        from torchrig_fsdp.options import FullyShardedDataParallelPlugin

        accelerator = Accelerator(cpu=True, strategy="fsdp",
                                  fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        root = Path(base)
        saved = []
        for name in ("a", "b"):
            accelerator.backward(model(torch.randn(2, 4)).sum())
            optimizer.step()
            saved.append(Path(accelerator.save_state(str(root / name), hashes=hashes)))
        outcomes = {}
        for case in CASES:
            directory = root / f"case-{case}"
            named = ""
            if ctx.rank == 0:
                shutil.copytree(saved[0], directory)
                named = tamper(case, directory, saved[1])
            dist.barrier()
            with torch.no_grad():
                for param in model.parameters():
                    param.fill_(7.0)  # a refusal must leave this value everywhere
            try:
                accelerator.load_state(str(directory))
                outcome = "loaded"
            except CheckpointError as exc:
                outcome = f"refused: {exc}"
            untouched = all(bool((p.full_tensor() if hasattr(p, "full_tensor") else p).eq(7.0).all())
                            for p in model.parameters())
            outcomes[case] = f"{outcome} | named={named} | untouched={untouched}"
            dist.barrier()
        return outcomes


@pytest.mark.multiprocess
@pytest.mark.parametrize("hashes", [True, False])
def test_tampered_dcp_checkpoints_are_refused_naming_the_file_before_live_state_changes(gloo_pool, tmp_path, hashes):
    results = gloo_pool.run(_tampered_fsdp_loads, str(tmp_path), hashes, timeout=RUN_TIMEOUT)
    named = {case: results[0][case].split("| named=")[1].split(" |")[0] for case in CASES}
    for rank_outcomes in results:
        for case, sizes_reveal in CASES.items():
            outcome = rank_outcomes[case]
            if not hashes and not sizes_reveal:
                continue  # the same size, no hash: nothing can tell (docs/checkpoints.md)
            assert outcome.startswith("refused"), (case, outcome)
            assert named[case] in outcome.split(" | named=")[0], (case, outcome)
            assert outcome.endswith("untouched=True"), (case, outcome)
    assert os.path.isdir(tmp_path / "a")


@pytest.mark.parametrize("hashes", [False, True])
def test_a_damaged_optimizer_header_is_refused_before_the_model_loads(tmp_path, hashes):
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    accelerator.backward(model(torch.randn(2, 3)).sum())
    optimizer.step()
    directory = Path(accelerator.save_state(str(tmp_path / "ckpt"), hashes=hashes))
    path = directory / "optimizer.safetensors"
    data = bytearray(path.read_bytes())
    data[8] = ord("[")  # the header's opening brace: same size, no longer a JSON object
    path.write_bytes(bytes(data))
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(7.0)
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        accelerator.load_state(str(directory))
    assert all(bool(p.eq(7.0).all()) for p in model.parameters())
