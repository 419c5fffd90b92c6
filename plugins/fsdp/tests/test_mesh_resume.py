"""Checkpoints across layouts: ``save_state`` under one device mesh, ``load_state`` under another, on four
gloo ranks — model and optimizer (AdamW) resharded by DCP, the data position and RNG restored — and the
training that continues matches an uninterrupted one-process run (losses and every parameter). Also: one
process to and from the mesh, refusals naming both layouts, ``save_model`` from every layout, meta-device
init under TP and FSDP2 x TP, and one real ``torchrig launch`` saving under one config file and resuming
under another.

Four ranks on two cores: the session's 4-rank pool, tiny model, one optimizer step per layout; every task has a
hard timeout.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import pytest
import torch
from torchrig.testing.contracts import rank_environment
from torchrig.testing.models import TP_PLAN, TinyLM, lm_data

pytestmark = pytest.mark.multiprocess

TIMEOUT = 120
GLOBAL_BATCH = 4  # every layout sees the same global batch: per-rank batch = 4 / data-parallel size
TOTAL_STEPS = 8  # one step per leg of the chain below


LAYOUTS = {
    # name: (parallelism_config, data-parallel size, how the manifest describes it)
    "fsdp2xtp": ({"dp_shard_size": 2, "tp_size": 2, "tp_plan": TP_PLAN}, 2, "dp_shard=2 x tp=2"),
    "fsdp4": ({"dp_shard_size": 4}, 4, "dp_shard=4"),
    "replicate_x_tp": ({"dp_replicate_size": 2, "tp_size": 2, "tp_plan": TP_PLAN}, 2, "dp_replicate=2 x tp=2"),
    "tp4": ({"tp_size": 4, "tp_plan": TP_PLAN}, 1, "tp=4"),
    "hsdp": ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4, "dp_replicate=2 x dp_shard=2"),
}


@pytest.fixture
def pool(gloo_pool4):
    """The session's 4-rank pool: started once for every module that needs 4 ranks."""
    return gloo_pool4


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).float().cpu().clone()


def _stage(parallelism: dict | None, dp_size: int, load_from: str | None, save_to: str, steps: int,
           allow_world_size_change: bool = False, state_dict_type: str = "SHARDED_STATE_DICT") -> dict:
    """One leg of a resumed run: build, prepare, load ``load_from`` (if any), train ``steps`` optimizer steps,
    save into ``save_to`` (DCP shards, or gathered with FULL_STATE_DICT). Returns this rank's losses, the
    gathered parameters and what the log said."""
    import logging

    from torchrig import Accelerator
    from torchrig_fsdp.options import FullyShardedDataParallelPlugin

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    root = logging.getLogger("torchrig")
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=parallelism or {},
                                  fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type=state_dict_type))
        torch.manual_seed(0)
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(lm_data(TOTAL_STEPS * GLOBAL_BATCH), batch_size=GLOBAL_BATCH // dp_size)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        if load_from is not None:
            accelerator.load_state(load_from, allow_world_size_change=allow_world_size_change)
        losses = []
        for tokens, labels in itertools.islice(loader, steps):  # no batch fetched beyond the last step
            loss = model(tokens, labels)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(_full(loss)))
        accelerator.save_state(save_to)
        params = {name: _full(p) for name, p in accelerator.unwrap_model(model).named_parameters()}
        accelerator.end_training()
        return {"losses": losses, "params": params, "log": records}
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _leg(ctx, layout: str, load_from: str | None, save_to: str, steps: int, **kwargs):
    parallelism, dp_size, _ = LAYOUTS[layout]
    with rank_environment(ctx.rank, ctx.world_size):
        return _stage(parallelism, dp_size, load_from, save_to, steps, **kwargs)


def _reference(steps: int) -> dict:
    """One process, global batches, the same seed and data: what every resumed chain must reproduce."""
    torch.manual_seed(0)
    model = TinyLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(lm_data(TOTAL_STEPS * GLOBAL_BATCH), batch_size=GLOBAL_BATCH)
    losses = []
    for step, (tokens, labels) in enumerate(loader):
        if step == steps:
            break
        loss = model(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _mean_loss(results: list[dict], layout: str, step: int) -> float:
    """The global batch's loss: the mean over the data-parallel ranks (the ranks of one tp group agree)."""
    _, dp_size, _ = LAYOUTS[layout]
    tp = 4 // dp_size
    return sum(results[dp * tp]["losses"][step] for dp in range(dp_size)) / dp_size


def test_resume_across_layouts_continues_like_one_uninterrupted_process(pool, tmp_path):
    """1 process -> FSDP2 x TP -> FSDP 4 -> TP 2 x replicas -> TP 4 -> HSDP -> FSDP 4 -> 1 process, one optimizer
    step each, through DCP: every leg's loss and the final parameters are the uninterrupted reference's."""
    chain = ["fsdp2xtp", "fsdp4", "replicate_x_tp", "tp4", "hsdp", "fsdp4"]
    assert len(chain) + 2 == TOTAL_STEPS
    reference = _reference(TOTAL_STEPS)
    with rank_environment(0, 1):
        first = _stage(None, 1, None, str(tmp_path / "c0"), 1)
    assert first["losses"] == pytest.approx(reference["losses"][:1], rel=1e-5)
    previous, before = str(tmp_path / "c0"), "fsdp on 1 process"
    for index, layout in enumerate(chain, start=1):
        target = str(tmp_path / f"c{index}")
        results = pool.run(_leg, layout, previous, target, 1, allow_world_size_change=index == 1, timeout=TIMEOUT)
        assert _mean_loss(results, layout, 0) == pytest.approx(reference["losses"][index], rel=1e-4, abs=1e-5), layout
        described = LAYOUTS[layout][2]
        assert any(f"resharding from {before} to {described}" in line for line in results[0]["log"]), results[0]["log"]
        previous, before = target, described
        if layout == "fsdp2xtp":  # merge-weights: the 2-D shards into full weights, no process group
            from safetensors.torch import load_file
            from torchrig_fsdp.merge import merge_weights

            merged = load_file(merge_weights(target, str(tmp_path / "merged"))[0])
            for name, tensor in results[0]["params"].items():
                torch.testing.assert_close(merged[name], tensor, rtol=0, atol=0)
    with rank_environment(0, 1):
        last = _stage(None, 1, previous, str(tmp_path / "final"), 1, allow_world_size_change=True)
    assert last["losses"] == pytest.approx(reference["losses"][-1:], rel=1e-4, abs=1e-5)
    for name, expected in reference["params"].items():
        torch.testing.assert_close(last["params"][name], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    manifest = json.loads((tmp_path / "c3" / "torchrig_checkpoint.json").read_text())
    assert manifest["layout"]["mesh"] == {"dp_replicate": 2, "dp_shard": 1, "tp": 2}
    assert manifest["layout"]["data_parallel_size"] == 2
    # the keys are the model's own FQNs whatever the layout: what lets DCP match them across meshes
    for name in ("pytorch_model_fsdp_0", "optimizer_0"):
        keys = [_dcp_keys(tmp_path / f"c{index}" / name) for index in range(len(chain) + 1)]
        assert all(k == keys[0] for k in keys), name
    assert "optimizer.state.blocks.0.attn.q.weight.exp_avg" in _dcp_keys(tmp_path / "c1" / "optimizer_0")


def _dcp_keys(path) -> set[str]:
    from torchrig_fsdp import safe_dcp

    return set(safe_dcp.reader(str(path), allow_pickle=False).read_metadata().state_dict_metadata)


# -- save_model: one full safetensors file from every layout -------------------------------------------------


def _save_model(ctx, layout: str, directory: str, max_shard_size: str):
    from torchrig import Accelerator

    parallelism, dp_size, _ = LAYOUTS[layout]
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=parallelism)
        torch.manual_seed(0)
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(lm_data(GLOBAL_BATCH), batch_size=GLOBAL_BATCH // dp_size)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        for tokens, labels in loader:
            accelerator.backward(model(tokens, labels))
            optimizer.step()
        written = accelerator.save_model(model, directory, max_shard_size=max_shard_size)
        state = accelerator.get_state_dict(model)
        params = {name: _full(p) for name, p in accelerator.unwrap_model(model).named_parameters()}
        accelerator.end_training()
        return {"written": [os.path.basename(path) for path in written], "state": state, "params": params}


@pytest.mark.parametrize(("layout", "max_shard_size"), [("tp4", "20KB"), ("hsdp", "10GB")])
def test_save_model_gathers_a_full_safetensors_model_from_the_layout(pool, tmp_path, layout, max_shard_size):
    from safetensors.torch import load_file

    directory = tmp_path / "weights"
    results = pool.run(_save_model, layout, str(directory), max_shard_size, timeout=TIMEOUT)
    assert all(not result["written"] for result in results[1:])  # the main process writes
    assert all(not result["state"] for result in results[1:])  # get_state_dict: on the main process
    weights = {}
    for name in results[0]["written"]:
        if name.endswith(".safetensors"):
            weights.update(load_file(directory / name))
    if max_shard_size == "20KB":  # several files and Hugging Face's index
        assert (directory / "model.safetensors.index.json").is_file() and len(results[0]["written"]) > 2
    plain = TinyLM()
    plain.load_state_dict(weights)  # strict: every name, full shapes
    for name, tensor in plain.named_parameters():
        torch.testing.assert_close(tensor.detach(), results[0]["params"][name], rtol=0, atol=0)
        torch.testing.assert_close(results[0]["state"][name].float(), results[0]["params"][name], rtol=0, atol=0)


# -- what cannot be resumed is refused, naming both layouts ------------------------------------------------


def test_a_sharded_checkpoint_read_by_a_strategy_without_dcp_is_refused_naming_both_layouts(pool, tmp_path):
    from torchrig import Accelerator
    from torchrig.checkpoint import CheckpointError

    checkpoint = str(tmp_path / "sharded")
    pool.run(_leg, "fsdp2xtp", None, checkpoint, 1, timeout=TIMEOUT)
    with rank_environment(0, 1):
        accelerator = Accelerator(cpu=True)  # the single-process strategy reads plain state dicts only
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(lm_data(TOTAL_STEPS * GLOBAL_BATCH), batch_size=GLOBAL_BATCH)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        with pytest.raises(CheckpointError) as caught:
            accelerator.load_state(checkpoint, allow_world_size_change=True)
        accelerator.end_training()
    message = str(caught.value)
    assert "saved by the strategy 'fsdp' under dp_shard=2 x tp=2" in message, message
    assert "the strategy 'single' (single on 1 process) cannot read" in message, message
    assert "model.safetensors" in message and model is not None


# -- meta-device init: no rank ever holds the whole model -------------------------------------------------------


def _meta_init(ctx, layout: str | None, batch_bytes: int | None = None):
    from torchrig import Accelerator, init_empty_weights
    from torchrig_fsdp import materialize

    parallelism = LAYOUTS[layout][0] if layout else {}
    default_batch = materialize.BATCH_BYTES
    materialize.BATCH_BYTES = batch_bytes or default_batch  # 1: every module is sharded out on its own
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=parallelism)
        torch.manual_seed(0)
        with init_empty_weights():
            model = TinyLM()
        meta_before = all(p.is_meta for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        params = {name: _full(p) for name, p in accelerator.unwrap_model(model).named_parameters()}
        meta_after = any(p.is_meta for p in model.parameters())
        tokens, labels = lm_data(GLOBAL_BATCH)[:]
        loss = model(tokens, labels)  # every rank the same batch: a forward works on the materialised shards
        accelerator.backward(loss)
        optimizer.step()
        accelerator.end_training()
        materialize.BATCH_BYTES = default_batch
        return {"meta_before": meta_before, "meta_after": meta_after, "local": local, "params": params,
                "loss": float(_full(loss))}


@pytest.mark.parametrize(("layout", "batch_bytes"), [("fsdp2xtp", 1), ("tp4", None), ("hsdp", None)])
def test_meta_device_init_is_sharded_before_it_is_materialised_and_matches_the_seeded_model(pool, layout,
                                                                                            batch_bytes):
    """``init_empty_weights`` + prepare under TP / FSDP2 x TP / HSDP: parameters stay meta until prepare, each rank
    then holds a shard, and the weights are those of ``manual_seed(0); TinyLM()`` — sharded out module by
    module (``batch_bytes`` 1) or all at once."""
    torch.manual_seed(0)
    reference = TinyLM()
    total = sum(p.numel() for p in reference.parameters())
    expected = reference(*lm_data(GLOBAL_BATCH)[:]).detach()
    results = pool.run(_meta_init, layout, batch_bytes, timeout=TIMEOUT)
    for result in results:
        assert result["meta_before"] and not result["meta_after"]
        assert result["local"] <= total / 2  # a shard (HSDP: half, replicated twice), never the model
        for name, tensor in reference.named_parameters():
            torch.testing.assert_close(result["params"][name], tensor.detach(), rtol=0, atol=0,
                                       msg=lambda m: f"{name}: {m}")
        assert result["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_meta_device_init_in_one_process_and_a_module_nothing_can_initialise():
    from torchrig import Accelerator, init_empty_weights
    from torchrig_fsdp.strategy import FSDPConfigError

    class Scale(torch.nn.Module):  # a parameter, and no reset_parameters()
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(3))

    class _One:
        rank, world_size = 0, 1

    result = _meta_init(_One(), None)
    torch.manual_seed(0)
    for name, tensor in TinyLM().named_parameters():
        torch.testing.assert_close(result["params"][name], tensor.detach(), rtol=0, atol=0)
    with rank_environment(0, 1):
        accelerator = Accelerator(cpu=True, strategy="fsdp")
        with init_empty_weights():
            model = torch.nn.Sequential(torch.nn.Linear(3, 3), Scale())
        with pytest.raises(FSDPConfigError, match=r"fsdp_config.param_init_fn: .*without reset_parameters\(\) \(1\)"):
            accelerator.prepare(model)
        accelerator.end_training()


# -- a real launch: save under one config file, resume under another ----------------------------------------

SCRIPT = os.path.join(os.path.dirname(__file__), "launch_scripts", "mesh_resume.py")


def _launch(tmp_path, name: str, parallelism: dict, steps: int, resume: str | None = None) -> tuple[str, list[dict]]:
    out = tmp_path / name
    out.mkdir()
    config = tmp_path / f"{name}.yaml"
    config.write_text(json.dumps({"distributed_type": "FSDP", "parallelism_config": parallelism,
                                  "fsdp_config": {"fsdp_state_dict_type": "SHARDED_STATE_DICT"}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "4", "--config_file", str(config),
               "--log_dir", str(tmp_path / f"logs-{name}"), SCRIPT, str(out), str(steps), *([resume] if resume else [])]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, start_new_session=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return str(out), [json.loads((out / f"report-{rank}.json").read_text()) for rank in range(4)]


def test_launch_saves_under_one_config_file_and_resumes_under_another(tmp_path):
    """``torchrig launch --cpu --num_processes 4``: 2 steps under FSDP2 x TP (a config file), then 2 more
    resumed under HSDP 2 x 2 (another file): the four losses and the parameters are the one-process run's."""
    reference = _reference(4)
    first, saved = _launch(tmp_path, "fsdp2xtp", {"dp_shard_size": 2, "tp_size": 2, "tp_plan": TP_PLAN}, 2)
    assert saved[0]["mesh"] == {"dp_shard": 2, "tp": 2}
    _, resumed = _launch(tmp_path, "hsdp", {"dp_replicate_size": 2, "dp_shard_size": 2}, 2,
                         resume=os.path.join(first, "checkpoint"))
    assert resumed[0]["mesh"] == {"dp_replicate": 2, "dp_shard": 2}
    assert any("resharding from dp_shard=2 x tp=2 to dp_replicate=2 x dp_shard=2" in line for line in resumed[0]["log"])
    losses = [(saved[0]["losses"][i] + saved[2]["losses"][i]) / 2 for i in range(2)]
    losses += [sum(report["losses"][i] for report in resumed) / 4 for i in range(2)]
    assert losses == pytest.approx(reference["losses"], rel=1e-4, abs=1e-5)
    params = torch.load(tmp_path / "hsdp" / "params.pt")
    for name, expected in reference["params"].items():  # four Adam steps: rounding differences grow a little
        torch.testing.assert_close(params[name], expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


def _ddp_leg(ctx, save_to: str):
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="ddp")
        torch.manual_seed(0)
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(lm_data(TOTAL_STEPS * GLOBAL_BATCH), batch_size=GLOBAL_BATCH // 4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        tokens, labels = next(iter(loader))
        loss = model(tokens, labels)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.save_state(save_to)
        accelerator.end_training()
        return float(loss.detach())


def test_a_ddp_checkpoint_resumes_under_fsdp2_x_tp(pool, tmp_path):
    """DDP's plain checkpoint (model.safetensors, position-keyed optimizer.safetensors) is read on rank 0,
    re-keyed by parameter name and distributed over the mesh; training continues like one process."""
    reference = _reference(2)
    checkpoint = str(tmp_path / "ddp")
    losses = pool.run(_ddp_leg, checkpoint, timeout=TIMEOUT)
    assert sum(losses) / 4 == pytest.approx(reference["losses"][0], rel=1e-4, abs=1e-5)
    assert os.path.isfile(os.path.join(checkpoint, "optimizer.safetensors"))
    results = pool.run(_leg, "fsdp2xtp", checkpoint, str(tmp_path / "mesh"), 1, timeout=TIMEOUT)
    assert _mean_loss(results, "fsdp2xtp", 0) == pytest.approx(reference["losses"][1], rel=1e-4, abs=1e-5)
    assert any("resharding from ddp on 4 processes to dp_shard=2 x tp=2" in line for line in results[0]["log"])
    for name, expected in reference["params"].items():
        torch.testing.assert_close(results[0]["params"][name], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
