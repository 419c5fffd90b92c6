"""Pipeline parallelism (``parallelism_config.pp_size``) of the fsdp strategy on gloo ranks: GPipe, 1F1B,
a hand-written ``pp_split_fn`` and Interleaved1F1B on two ranks, pipeline x FSDP2, interleaved x FSDP2 and
pipeline x TP on four, each compared with a one-process reference of the same model, data and seed (the loss
of every step, the clipped norm, the forward-only loss, every parameter after training), with gradient
clipping and accumulation 2; refusals; pipeline checkpoints resumed in one process; gather_for_metrics; and
one real ``torchrig launch --num_processes 4`` from a config file.

One, two and four ranks on two cores: the session's pools (idle ranks cost memory, not CPU), tiny model, few steps;
each task has a hard timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torchrig.testing.contracts import rank_environment
from torchrig.testing.models import PipeLM, lm_data, lm_loss
from torchrig.testing.pool import checked_pool

pytestmark = pytest.mark.multiprocess

TIMEOUT = 120
PER_RANK, STEPS, ACCUMULATION, CLIP = 4, 2, 2, 0.5
SPLIT = ["layers.2"]


@pytest.fixture(scope="module")
def one_rank_pool():
    with checked_pool(1) as pool:
        yield pool


@pytest.fixture
def pools(one_rank_pool, gloo_pool, gloo_pool4):
    """``pools(n)``: a pool of ``n`` ranks — the session's 2- and 4-rank pools, this module's 1-rank one. Each
    starts on its first task and stays up: switching sizes used to close one and start the other (~5-9 s each)."""
    return {1: one_rank_pool, 2: gloo_pool, 4: gloo_pool4}.__getitem__


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).float().cpu()


def _train(ctx, parallelism: dict, dp_size: int, save: str | None = None):
    from torchrig import Accelerator, ParallelismConfig
    from torchrig_fsdp.options import FullyShardedDataParallelPlugin

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", gradient_accumulation_steps=ACCUMULATION,
                                  parallelism_config=ParallelismConfig(**parallelism, pp_loss_fn=lm_loss),
                                  fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
        torch.manual_seed(0)
        model = PipeLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(lm_data(STEPS * ACCUMULATION * PER_RANK * dp_size), batch_size=PER_RANK)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        losses, norms = [], []
        for tokens, labels in loader:
            with accelerator.accumulate(model):
                loss = model(tokens, target=labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        model.eval()
        with torch.no_grad():  # forward only (the schedule's eval): the loss of the last batch again
            evaluated = float(model(tokens, target=labels))
        model.train()
        if save:
            accelerator.save_state(save)
        params = {name: _full(p) for name, p in accelerator.unwrap_model(model).named_parameters()}
        caps = accelerator.strategy_capabilities
        mesh = accelerator.torch_device_mesh
        return {"losses": losses, "norms": norms, "params": params, "evaluated": evaluated,
                "dp": (caps.data_parallel_size, caps.data_parallel_rank),
                "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)),
                "optimizer_params": sum(len(group["params"]) for group in optimizer.param_groups),
                "schedule": type(model.schedule).__name__, "microbatches": model.microbatches}


def _reference(dp_size: int, epochs: int = 1) -> dict:
    """One process, the batches of every data-parallel rank of a step concatenated (same seed, same data)."""
    torch.manual_seed(0)
    model = PipeLM()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(lm_data(STEPS * ACCUMULATION * PER_RANK * dp_size),
                                         batch_size=PER_RANK * dp_size)
    losses, norms = [], []
    for index, (tokens, labels) in enumerate(batch for _ in range(epochs) for batch in loader):
        loss = lm_loss(model(tokens), labels)
        (loss / ACCUMULATION).backward()
        if (index + 1) % ACCUMULATION == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        evaluated = float(lm_loss(model(tokens), labels))
    return {"losses": losses, "norms": norms, "initial": initial, "evaluated": evaluated,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


PP_TP_PLAN = {"embed": "embedding", "layers.*.attn.[qkv]": "colwise", "layers.*.attn.o": "rowwise",
              "layers.*.mlp.up": "colwise", "layers.*.mlp.down": "rowwise", "head": "output"}
INTERLEAVED = {"pp_size": 2, "pp_split_points": ["layers.1", "layers.2", "layers.3"], "pp_schedule": "Interleaved1F1B"}
def split_by_hand(model, stage, num_stages):
    """A ``pp_split_fn``: the same cut as SPLIT, written by hand (names kept)."""
    for index in (range(2, 4) if stage == 0 else range(2)):
        del model.layers._modules[str(index)]
    if stage == 0:
        model.norm = model.head = None
    else:
        model.embed = None
    return model


GPIPE = {"pp_size": 2, "pp_split_points": SPLIT, "pp_schedule": "GPipe"}
LAYOUTS = {
    # name: (world size, parallelism_config, data-parallel size, mesh)
    "gpipe": (2, GPIPE, 1, {"pp": 2, "dp_shard": 1}),
    "1f1b": (2, {"pp_size": 2, "pp_split_points": SPLIT, "pp_schedule": "1F1B", "pp_microbatches": 4}, 1,
             {"pp": 2, "dp_shard": 1}),
    "pp_x_fsdp": (4, {"pp_size": 2, "dp_shard_size": 2, "pp_split_points": SPLIT}, 2, {"pp": 2, "dp_shard": 2}),
    "split_fn": (2, {"pp_size": 2, "pp_split_fn": split_by_hand}, 1, {"pp": 2, "dp_shard": 1}),
    # four stages, two per rank (0 and 2 on the first, 1 and 3 on the second)
    "interleaved": (2, INTERLEAVED, 1, {"pp": 2, "dp_shard": 1}),
    "interleaved_x_fsdp": (4, {**INTERLEAVED, "dp_shard_size": 2}, 2, {"pp": 2, "dp_shard": 2}),
    "pp_x_tp": (4, {"pp_size": 2, "tp_size": 2, "pp_split_points": SPLIT, "tp_plan": PP_TP_PLAN}, 1,
                {"pp": 2, "dp_shard": 1, "tp": 2}),
}


def _rank_units(layout: str, pp_rank: int) -> set[str]:
    """The modules the ``pp`` rank holds (under their names in the whole model)."""
    if layout.startswith("interleaved"):
        return {"embed", "layers.0", "layers.2"} if pp_rank == 0 else {"layers.1", "layers.3", "norm", "head"}
    return {"embed", "layers.0", "layers.1"} if pp_rank == 0 else {"layers.2", "layers.3", "norm", "head"}


@pytest.mark.parametrize("layout", ["gpipe", "1f1b", "interleaved", "split_fn"])
def test_pipeline_stages_train_like_one_process(pools, layout):
    _check_layout(pools, layout)


def _check_layout(pools, layout: str, save: str | None = None) -> None:
    world, parallelism, dp_size, mesh = LAYOUTS[layout]
    results = pools(world).run(_train, parallelism, dp_size, save, timeout=TIMEOUT)
    reference = _reference(dp_size)
    per_stage, tp_size = world // 2, mesh.get("tp", 1)  # pp outermost: ranks 0..per_stage-1 hold stage 0
    for rank, result in enumerate(results):
        stage, dp_rank = rank // per_stage, rank % per_stage // tp_size
        assert result["mesh"] == mesh
        # the configured schedule runs, with the configured micro-batches (default pp_size)
        assert result["schedule"] == "Schedule" + parallelism.get("pp_schedule", "1F1B")
        assert result["microbatches"] == parallelism.get("pp_microbatches", parallelism["pp_size"])
        assert result["dp"] == (dp_size, dp_rank)  # the stages (and tp ranks) of one pipeline share batches
        units = {".".join(name.split(".")[:2]) if name.startswith("layers") else name.split(".")[0]
                 for name in result["params"]}
        assert units == _rank_units(layout, stage)
        assert result["optimizer_params"] == len(result["params"])  # the other stage's parameters left the optimizer
        # the loss is broadcast from the last stage: every rank of a pipeline returns it
        assert result["losses"] == results[per_stage + rank % per_stage]["losses"]
        for norm, expected in zip(result["norms"], reference["norms"], strict=True):
            assert norm == pytest.approx(expected, rel=1e-4)  # the total norm covers both stages (and the shards)
    first_ranks = range(0, per_stage, tp_size)  # one rank per data-parallel rank
    for step, expected in enumerate(reference["losses"]):
        mean = sum(results[rank]["losses"][step] for rank in first_ranks) / dp_size
        assert mean == pytest.approx(expected, rel=1e-4, abs=1e-5), (layout, step)
    evaluated = sum(results[rank]["evaluated"] for rank in first_ranks) / dp_size  # the schedule's forward only
    assert evaluated == pytest.approx(reference["evaluated"], rel=1e-4)
    trained = {}
    for result in results:
        trained.update(result["params"])
    assert trained.keys() == reference["params"].keys()  # original names: the stages together are the model
    for name, expected in reference["params"].items():
        torch.testing.assert_close(trained[name], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert not torch.equal(expected, reference["initial"][name]), f"{name} did not train in the reference"


def _refused(ctx) -> dict:
    from torchrig import Accelerator
    from torchrig.errors import ConfigError

    messages = {}
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config={"pp_size": 2})
        try:  # judged at prepare: a model may declare its own pipeline plan (transformers' base_model_pp_plan)
            accelerator.prepare(PipeLM())
        except ConfigError as exc:
            messages["no split"] = str(exc)
        accelerator.free_memory()
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=GPIPE)
        model = accelerator.prepare(PipeLM())
        tokens, labels = lm_data(4)[:]
        for name, call in (("no target", lambda: model(tokens)),
                           ("uneven", lambda: model(tokens[:3], target=labels[:3]))):
            try:
                call()
            except ValueError as exc:
                messages[name] = str(exc)
    return messages


def test_a_pipeline_without_a_split_a_forward_without_target_and_an_uneven_batch_are_refused(pools):
    for messages in pools(2).run(_refused, timeout=TIMEOUT):
        assert "parallelism_config.pp_split_points: pp_size is 2 but nothing says where to split PipeLM into " \
            "stages (and it declares no base_model_pp_plan" in messages["no split"]
        assert "call model(inputs, target=labels)" in messages["no target"]
        assert "pp_microbatches: the batch of 3 samples does not split into 2 micro-batches" in messages["uneven"]


def _resume(ctx, directory: str, dp_size: int) -> dict:
    """One process, the whole model: resume the pp 2 checkpoint (saved after one epoch) and train a second epoch."""
    from torchrig import Accelerator
    from torchrig_fsdp.options import FullyShardedDataParallelPlugin

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", gradient_accumulation_steps=ACCUMULATION,
                                  fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"))
        torch.manual_seed(1)  # other initial weights: the checkpoint must replace every one
        model = PipeLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        # the batches of every data-parallel rank of the saved run, concatenated
        loader = torch.utils.data.DataLoader(lm_data(STEPS * ACCUMULATION * PER_RANK * dp_size),
                                             batch_size=PER_RANK * dp_size)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        # the checkpoint's world size and pipeline keys differ on purpose: accepted explicitly
        accelerator.load_state(directory, allow_world_size_change=True, allow_config_change=True)
        losses = []
        for tokens, labels in loader:
            with accelerator.accumulate(model):
                loss = lm_loss(model(tokens), labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), CLIP)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        return {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()}}


@pytest.mark.parametrize("layout", ["gpipe", "interleaved_x_fsdp"])
def test_a_pipeline_checkpoint_resumes_in_one_process_with_the_whole_model(pools, tmp_path, layout):
    directory = str(tmp_path / "pp2")
    _check_layout(pools, layout, save=directory)
    (resumed,) = pools(1).run(_resume, directory, LAYOUTS[layout][2], timeout=TIMEOUT)
    reference = _reference(LAYOUTS[layout][2], epochs=2)
    half = STEPS * ACCUMULATION
    assert resumed["losses"] == pytest.approx(reference["losses"][half:], rel=1e-4, abs=1e-5)
    for name, expected in reference["params"].items():  # the optimizer's moments resumed too
        torch.testing.assert_close(resumed["params"][name], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("layout", ["pp_x_fsdp", "interleaved_x_fsdp", "pp_x_tp"])
def test_pipeline_x_data_or_tensor_parallel_trains_like_one_process(pools, layout):
    _check_layout(pools, layout)


def _gather_eval(ctx) -> tuple[list[int], int]:
    """Evaluation data over 11 samples (uneven) with gather_for_metrics under pp 2 x dp_shard 2."""
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=LAYOUTS["pp_x_fsdp"][1])
        loader = accelerator.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(11)),
                                                                 batch_size=2))
        seen = []
        for (ids,) in loader:
            seen += accelerator.gather_for_metrics(ids).tolist()
        return seen, len(accelerator.gather_for_metrics([ctx.rank], use_gather_object=True))


def test_gather_for_metrics_counts_every_sample_once_across_pipeline_stages(pools):
    for seen, objects in pools(4).run(_gather_eval, timeout=TIMEOUT):
        assert sorted(seen) == list(range(11))  # both stages of a pipeline read the same batches
        assert objects == 2  # one object per data-parallel rank


# -- a real launch from a config file -----------------------------------------------------------------

SCRIPT = os.path.join(os.path.dirname(__file__), "launch_scripts", "pipe_train.py")


def test_launch_four_cpu_processes_with_pipeline_x_fsdp_from_a_config_file(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    out.mkdir()
    config = tmp_path / "pipeline.yaml"
    config.write_text(json.dumps({
        "distributed_type": "FSDP",
        "parallelism_config": {"parallelism_config_pp_size": 2, "parallelism_config_dp_shard_size": 2,
                               "pp_split_points": SPLIT, "pp_schedule": "1F1B"},
        "gradient_accumulation_steps": ACCUMULATION,
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "4", "--config_file", str(config),
               "--log_dir", str(tmp_path / "logs"), SCRIPT, str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, start_new_session=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [json.loads((out / f"report-{rank}.json").read_text()) for rank in range(4)]
    reference = _reference(2)
    for rank, report in enumerate(reports):
        assert report["mesh"] == {"pp": 2, "dp_shard": 2} and report["dp"] == [2, rank % 2]
        assert not os.path.exists(f"/proc/{report['pid']}"), "a worker survived the launch"
    for step, expected in enumerate(reference["losses"]):
        assert (reports[0]["losses"][step] + reports[1]["losses"][step]) / 2 == pytest.approx(expected, rel=1e-4)
    trained = {}
    for rank in range(4):
        trained.update(torch.load(out / f"params-{rank}.pt"))
    assert trained.keys() == reference["params"].keys()
    for name, expected in reference["params"].items():
        torch.testing.assert_close(trained[name], expected, rtol=1e-4, atol=1e-5)
    # save_model joins both stages (each gathered over its dp_shard ranks) into one file a plain model loads
    plain = PipeLM()
    plain.load_state_dict(load_file(out / "weights" / "model.safetensors"))
    for name, tensor in plain.named_parameters():
        torch.testing.assert_close(tensor.detach(), reference["params"][name], rtol=1e-4, atol=1e-5)
    assert (out / "checkpoint").is_dir()
