"""The fsdp strategy's N-D mesh from ``parallelism_config`` on four gloo ranks: tensor parallel, FSDP2 x TP,
TP + sequence parallel + loss parallel, HSDP — each compared with a one-process reference of the same model,
data and seed (losses, and every parameter after training, gathered with ``full_tensor()``), with gradient
clipping and accumulation 2; and one real ``torchrig launch --num_processes 4`` from a config file.

Four ranks on two cores: the session's 4-rank pool, tiny model, few steps; each task has a hard timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torchrig.testing.contracts import rank_environment
from torchrig.testing.models import TP_PLAN, TP_SP_PLAN, TinyLM, lm_data

pytestmark = pytest.mark.multiprocess

TIMEOUT = 120
VOCAB, DIM, HEADS, SEQ, PER_RANK = 32, 32, 4, 8, 2
STEPS, ACCUMULATION = 2, 2


@pytest.fixture
def pool(gloo_pool4):
    """The session's 4-rank pool: started once for every module that needs 4 ranks."""
    return gloo_pool4


def _full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).float().cpu()


def _loop(accelerator, model, optimizer, loader, reduced=None) -> list[float]:
    losses = []
    for tokens, labels in loader:
        with accelerator.accumulate(model):
            loss = model(tokens, labels)
            accelerator.backward(loss)
            if reduced is not None:  # FSDP2 gives sharded .grad only once it reduce-scattered
                reduced.append(all(p.grad is not None for p in model.parameters()))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(_full(loss)))
    return losses


def _train(ctx, parallelism: dict, dp_size: int, mixed_precision: str = "no"):
    from torchrig import Accelerator, ParallelismConfig

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", gradient_accumulation_steps=ACCUMULATION,
                                  parallelism_config=ParallelismConfig(**parallelism), mixed_precision=mixed_precision)
        torch.manual_seed(0)
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = torch.utils.data.DataLoader(lm_data(STEPS * ACCUMULATION * PER_RANK * dp_size), batch_size=PER_RANK)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        caps = accelerator.strategy_capabilities
        mesh = accelerator.torch_device_mesh
        reduced: list[bool] = []
        losses = _loop(accelerator, model, optimizer, loader, reduced)
        params = {name: _full(p) for name, p in accelerator.unwrap_model(model).named_parameters()}
        kinds = sorted({type(p).__name__ for p in model.parameters()})
        head = accelerator.unwrap_model(model).head.weight
        return {"losses": losses, "params": params, "dp": (caps.data_parallel_size, caps.data_parallel_rank),
                "autocast": accelerator.step_plan.owners["autocast"], "reduced": reduced,
                "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)), "kinds": kinds,
                "head_local_rows": head.to_local().shape[0] if hasattr(head, "to_local") else None,
                "optimizer_params": [type(p).__name__ for group in optimizer.param_groups for p in group["params"]]}


def _reference(dp_size: int) -> dict:
    """One process, the batches of every data-parallel rank of a step concatenated (same seed, same data)."""
    torch.manual_seed(0)
    model = TinyLM()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = torch.utils.data.DataLoader(lm_data(STEPS * ACCUMULATION * PER_RANK * dp_size),
                                         batch_size=PER_RANK * dp_size)
    losses = []
    for index, (tokens, labels) in enumerate(loader):
        loss = model(tokens, labels)
        (loss / ACCUMULATION).backward()
        if (index + 1) % ACCUMULATION == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "initial": initial}


LAYOUTS = {
    # name: (parallelism_config, data-parallel size, mesh)
    "fsdp2xtp": ({"dp_shard_size": 2, "tp_size": 2, "tp_plan": TP_PLAN}, 2, {"dp_shard": 2, "tp": 2}),
    "tp4": ({"tp_size": 4, "tp_plan": TP_PLAN}, 1, {"dp_shard": 1, "tp": 4}),
    "tp_sp_loss_parallel": ({"dp_shard_size": -1, "tp_size": 2, "tp_plan": TP_SP_PLAN, "loss_parallel": True}, 2,
                            {"dp_shard": 2, "tp": 2}),
    "hsdp": ({"dp_replicate_size": 2, "dp_shard_size": 2}, 4, {"dp_replicate": 2, "dp_shard": 2}),
    # a 3-D mesh: replicas x (shards of 1) x tp
    "replicate_x_tp": ({"dp_replicate_size": 2, "tp_size": 2, "tp_plan": TP_PLAN}, 2,
                       {"dp_replicate": 2, "dp_shard": 1, "tp": 2}),
    # cp axes (no context-parallel attention on CPU: the cp ranks compute the whole sequence each, so
    # these check that FSDP2 shards over dp_shard_cp — 2-D with the replicas — and reduces correctly)
    "fsdp2xcp": ({"dp_shard_size": 2, "cp_size": 2}, 2, {"dp_shard": 2, "cp": 2}),
    "hsdp_x_cp": ({"dp_replicate_size": 2, "cp_size": 2}, 2, {"dp_replicate": 2, "dp_shard": 1, "cp": 2}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mesh_layout_trains_like_one_process(pool, layout):
    parallelism, dp_size, mesh = LAYOUTS[layout]
    results = pool.run(_train, parallelism, dp_size, timeout=TIMEOUT)
    reference = _reference(dp_size)
    tp_size = 4 // dp_size
    for rank, result in enumerate(results):
        assert result["mesh"] == mesh
        assert result["dp"] == (dp_size, rank // tp_size)  # the ranks of one tp group share batches
        assert set(result["optimizer_params"]) == {"DTensor"} or layout == "tp4"
        if layout != "tp4":  # no reduce-scatter on accumulation micro-steps, one on the step that syncs
            assert result["reduced"] == [False, True] * STEPS
        if layout == "fsdp2xcp":  # sharded over dp_shard x cp: 4 ranks, a quarter of the rows each
            assert result["head_local_rows"] == VOCAB // 4
        if layout == "hsdp_x_cp":  # replicated over dp_replicate, sharded over dp_shard_cp (= cp, 2 ranks)
            assert result["head_local_rows"] == VOCAB // 2
    # each step's loss: the mean over the data-parallel ranks = the reference's loss on the whole batch
    for step, expected in enumerate(reference["losses"]):
        mean = sum(results[dp * tp_size]["losses"][step] for dp in range(dp_size)) / dp_size
        assert mean == pytest.approx(expected, rel=1e-4, abs=1e-5), (layout, step)
    for name, expected in reference["params"].items():
        for result in results:
            torch.testing.assert_close(result["params"][name], expected, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
        assert not torch.equal(expected, reference["initial"][name]), f"{name} did not train in the reference"


@pytest.mark.parametrize(("layout", "precision"), [("fsdp2xtp", "bf16"), ("fsdp2xtp", "fp16"), ("tp4", "bf16")])
def test_mixed_precision_under_tp_is_fsdps_policy_with_a_data_axis_and_autocast_without(pool, layout, precision):
    parallelism, dp_size, _ = LAYOUTS[layout]
    results = pool.run(_train, parallelism, dp_size, precision, timeout=TIMEOUT)
    reference = _reference(dp_size)
    for result in results:
        # FSDP2's MixedPrecisionPolicy casts when there is a data axis to shard over; TP alone has
        # no fully_shard, so the precision plugin's autocast must be installed instead
        assert result["autocast"] == ("core" if layout == "fsdp2xtp" else f"precision:{precision}")  # core: nullcontext
        assert all(p.dtype == torch.float32 for p in result["params"].values())  # fp32 master weights
    mean = sum(results[dp * (4 // dp_size)]["losses"][-1] for dp in range(dp_size)) / dp_size
    assert mean == pytest.approx(reference["losses"][-1], rel=5e-2)


def _gather_eval(ctx, parallelism: dict):
    """Evaluation over 11 samples (uneven: the loader pads the last batch) with gather_for_metrics."""
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=parallelism)
        dataset = torch.utils.data.TensorDataset(torch.arange(11))
        loader = accelerator.prepare(torch.utils.data.DataLoader(dataset, batch_size=2))
        seen = []
        for (ids,) in loader:
            seen += accelerator.gather_for_metrics(ids).tolist()
        objects = accelerator.gather_for_metrics([ctx.rank], use_gather_object=True)
        return seen, objects


@pytest.mark.parametrize("layout", ["fsdp2xtp", "replicate_x_tp", "tp4", "hsdp"])
def test_gather_for_metrics_counts_every_sample_once_across_tp_ranks(pool, layout):
    parallelism, dp_size, _ = LAYOUTS[layout]
    for seen, objects in pool.run(_gather_eval, parallelism, timeout=TIMEOUT):
        assert sorted(seen) == list(range(11))
        assert len(objects) == dp_size  # one object per data-parallel rank


def _submeshes(ctx, parallelism: dict):
    """The named sub-meshes (as the group ranks each spans), ``gather``/``reduce`` over the world and over
    the data-parallel ranks, and ``maybe_context_parallel`` on this CPU mesh."""
    import torch.distributed as dist
    from torchrig import Accelerator
    from torchrig.errors import ConfigError

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=parallelism)
        named = {name: (tuple(mesh.mesh_dim_names), sorted(dist.get_process_group_ranks(mesh.get_group())))
                 for name, mesh in accelerator.device_submeshes.items()}
        root_dp = accelerator.torch_device_mesh["dp"].size()  # torch's own slicing finds the flattened axis too
        mine = torch.tensor([ctx.rank])
        collected = {"world": accelerator.gather(mine).tolist(), "data": accelerator.gather(mine, over="data").tolist(),
                     "sum_world": int(accelerator.reduce(mine, "sum")),
                     "sum_data": int(accelerator.reduce(mine.clone(), "sum", over="data"))}
        try:
            accelerator.gather(mine, over="tp")
        except ValueError as exc:
            collected["bad_over"] = str(exc)
        ids = torch.arange(16).reshape(1, 16)
        try:
            with accelerator.maybe_context_parallel(buffers=[ids], buffer_seq_dims=[1]):
                refused = None
        except ConfigError as exc:
            refused = str(exc)
        return named, root_dp, collected, refused, ids.shape


def test_named_submeshes_data_collectives_and_context_parallel_refused_on_cpu(pool):
    # dp_replicate 2 x cp 2: dp = the replicas, dp_shard_cp = the cp pair, dp_cp = everyone
    for rank, (named, root_dp, collected, refused, shape) in enumerate(
            pool.run(_submeshes, {"dp_replicate_size": 2, "cp_size": 2}, timeout=TIMEOUT)):
        pair, peers = sorted({rank, rank ^ 1}), sorted({rank % 2, rank % 2 + 2})
        assert named["dp"] == (("dp",), peers) and named["cp"] == (("cp",), pair)
        assert named["dp_shard_cp"] == (("dp_shard_cp",), pair) and named["dp_cp"] == (("dp_cp",), [0, 1, 2, 3])
        assert named["dp_replicate"] == (("dp_replicate",), peers) and root_dp == 2
        assert collected["world"] == [0, 1, 2, 3] and collected["sum_world"] == 6
        assert collected["data"] == peers and collected["sum_data"] == sum(peers)
        assert "over='tp'" in collected["bad_over"]
        assert "parallelism_config.cp_size" in refused and "CUDA devices only" in refused
        assert tuple(shape) == (1, 16)  # refused before anything was sharded
    # dp_shard 2 x tp 2: no cp axis, so maybe_context_parallel is a no-op
    for rank, (named, _, collected, refused, _) in enumerate(
            pool.run(_submeshes, {"dp_shard_size": 2, "tp_size": 2, "tp_plan": TP_PLAN}, timeout=TIMEOUT)):
        peers = sorted({rank % 2, rank % 2 + 2})
        assert named["dp"] == (("dp",), peers) and named["dp_shard_cp"] == (("dp_shard_cp",), peers)
        assert named["tp"] == (("tp",), sorted({rank, rank ^ 1})) and "cp" not in named
        assert collected["data"] == peers and refused is None


def _ring_attention_on_cpu(ctx):
    """torch's context parallel for real on the cp sub-mesh, up to the attention kernel (which CPUs lack):
    buffers sharded head-tail and restored, the guard installed over torch's SDPA and removed, refusals
    raised inside the real context, and leaving it without an SDPA call refused."""
    from torchrig import Accelerator
    from torchrig.accelerator.context_parallel import AttentionGuard, ring_attention
    from torchrig.errors import ConfigError

    sdpa = torch.nn.functional.scaled_dot_product_attention
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config={"dp_shard_size": 2, "cp_size": 2})
        cp = accelerator.device_submeshes["cp"]
        ids = torch.arange(16).reshape(1, 16)
        seen, refusals, kept_lengths = {}, [], []
        q = torch.randn(1, 2, 8, 4)
        for load_balance in (True, False):
            kept = torch.arange(16).reshape(1, 16)
            try:
                with ring_attention(cp, [ids, kept], [1, 1], [kept], comm_strategy="allgather",
                                    load_balance=load_balance):
                    seen[load_balance] = ids.tolist()[0]
                    assert isinstance(torch.nn.functional.scaled_dot_product_attention, AttentionGuard)
                    torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
            except ConfigError as exc:
                refusals.append(str(exc))
            kept_lengths.append(kept.shape[1])
        try:
            with ring_attention(cp, [ids], [1], [], comm_strategy="alltoall", load_balance=False):
                ids.float().softmax(-1)  # "attention" that never calls SDPA
        except ConfigError as exc:
            refusals.append(str(exc))
        restored = torch.nn.functional.scaled_dot_product_attention is sdpa
        return seen, ids.tolist()[0], kept_lengths, refusals, restored, cp.get_local_rank()


def test_ring_attention_shards_restores_and_refuses_around_torchs_context_parallel(pool):
    for seen, ids, kept, refusals, restored, cp_rank in pool.run(_ring_attention_on_cpu, timeout=TIMEOUT):
        # head-tail: 4 chunks of 4, cp rank 0 holds the first and last, rank 1 the middle two
        chunks = [list(range(i, i + 4)) for i in range(0, 16, 4)]
        expected = chunks[0] + chunks[3] if cp_rank == 0 else chunks[1] + chunks[2]
        assert seen[True] == expected
        assert seen[False] == list(range(8 * cp_rank, 8 * cp_rank + 8))  # contiguous halves
        assert ids == list(range(16)) and kept == [8, 8]  # restored, except the no_restore buffer
        assert len(refusals) == 3 and restored
        assert all("attn_mask: an explicit attention mask" in text for text in refusals[:2])
        assert "no torch.nn.functional.scaled_dot_product_attention call ran inside the context" in refusals[2]


def _refused(ctx, parallelism: dict, mixed_precision: str = "no"):
    from torchrig import Accelerator
    from torchrig.errors import ConfigError
    from torchrig_fsdp.strategy import FSDPConfigError

    with rank_environment(ctx.rank, ctx.world_size):
        try:
            accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config=parallelism,
                                      mixed_precision=mixed_precision)
            torch.manual_seed(0)
            accelerator.prepare(TinyLM())
        except (ConfigError, FSDPConfigError) as exc:
            return str(exc)
        return None


def test_tp_without_a_plan_and_a_pattern_matching_nothing_are_refused_naming_the_key(pool):
    for message in pool.run(_refused, {"tp_size": 4}, timeout=TIMEOUT):
        assert "parallelism_config.tp_plan" in message and "declares none" in message
    plan = {**TP_PLAN, "blocks.*.ffn.gate": "colwise"}
    for message in pool.run(_refused, {"tp_size": 4, "tp_plan": plan}, timeout=TIMEOUT):
        assert "'blocks.*.ffn.gate' matches no module of TinyLM" in message
    for message in pool.run(_refused, {"tp_size": 3}, timeout=TIMEOUT):
        assert "parallelism_config.tp_size" in message and "world size" in message
    # -1 hides "tp alone" from the check before launch; the strategy refuses it with the real world size
    for message in pool.run(_refused, {"tp_size": -1, "tp_plan": TP_PLAN}, "fp16", timeout=TIMEOUT):
        assert "fp16 with tensor parallel alone" in message and "use bf16" in message


def _parallelize_fn(ctx):
    """``FullyShardedDataParallelPlugin(parallelize_fn=...)`` receives the whole mesh and applies TP itself."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchrig import Accelerator
    from torchrig_fsdp.options import FullyShardedDataParallelPlugin

    seen = []

    def parallelize(model, mesh):
        seen.append(tuple(mesh.mesh_dim_names))
        for block in model.blocks:
            parallelize_module(block.mlp, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", parallelism_config={"dp_shard_size": 2, "tp_size": 2},
                                  fsdp_plugin=FullyShardedDataParallelPlugin(parallelize_fn=parallelize))
        torch.manual_seed(0)
        model = accelerator.prepare(TinyLM())
        up = model.blocks[0].mlp.up.weight
        return seen, [str(p) for p in up.placements], tuple(up.to_local().shape)


def test_parallelize_fn_gets_the_mesh_and_fsdp_shards_on_top(pool):
    for seen, placements, local in pool.run(_parallelize_fn, timeout=TIMEOUT):
        assert seen == [("dp_shard", "tp")]
        assert len(placements) == 2 and local == (2 * DIM // 4, DIM)  # rows split over tp, then over dp_shard


ONE_PROCESS = """
import torch
from torchrig import Accelerator
from torchrig.errors import ConfigError
try:
    Accelerator(cpu=True, strategy="fsdp", parallelism_config={"tp_size": 2})
except ConfigError as exc:
    print("refused:", exc)
"""


def test_one_process_asking_for_a_mesh_is_refused_not_run_unsharded(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", ONE_PROCESS], capture_output=True, text=True, timeout=120, env=env)
    assert "refused:" in result.stdout and "parallelism_config.tp_size" in result.stdout, result.stderr[-2000:]
    assert "world size is 1" in result.stdout


# -- a real launch from a config file -----------------------------------------------------------------

SCRIPT = os.path.join(os.path.dirname(__file__), "launch_scripts", "mesh_train.py")


#: Accelerate's spelling in the file (parallelism_config_<axis>_size) for the sizes, torchrig's for the plan.
_ACCELERATE_SPELLING = {"dp_replicate_size": "parallelism_config_dp_replicate_size",
                        "dp_shard_size": "parallelism_config_dp_shard_size", "tp_size": "parallelism_config_tp_size"}


@pytest.mark.parametrize("layout", ["fsdp2xtp", "tp4", "hsdp"])
def test_launch_four_cpu_processes_from_a_parallelism_config_file(tmp_path, layout):
    from safetensors.torch import load_file

    options, dp_size, mesh = LAYOUTS[layout]
    out = tmp_path / "out"
    out.mkdir()
    config = tmp_path / "mesh.yaml"
    config.write_text(json.dumps({
        "distributed_type": "FSDP",
        "parallelism_config": {_ACCELERATE_SPELLING.get(key, key): value for key, value in options.items()},
        "gradient_accumulation_steps": ACCUMULATION,
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "4", "--config_file", str(config),
               "--log_dir", str(tmp_path / "logs"), SCRIPT, str(out), str(STEPS)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env, start_new_session=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [json.loads((out / f"report-{rank}.json").read_text()) for rank in range(4)]
    reference = _reference(dp_size)
    by_dp_rank: dict[int, dict] = {}
    for report in reports:
        assert report["mesh"] == mesh and report["dp"][0] == dp_size
        assert not os.path.exists(f"/proc/{report['pid']}"), "a worker survived the launch"
        by_dp_rank.setdefault(report["dp"][1], report)
    assert sorted(by_dp_rank) == list(range(dp_size))  # tp ranks of one replica share a data-parallel rank
    for step, expected in enumerate(reference["losses"]):
        mean = sum(report["losses"][step] for report in by_dp_rank.values()) / dp_size
        assert mean == pytest.approx(expected, rel=1e-4)
    params = torch.load(out / "params.pt")
    for name, expected in reference["params"].items():
        torch.testing.assert_close(params[name], expected, rtol=1e-4, atol=1e-5)
    # save_model gathers the layout into one safetensors file a plain model loads
    weights = load_file(out / "weights" / "model.safetensors")
    plain = TinyLM()
    plain.load_state_dict(weights)
    for name, tensor in plain.named_parameters():
        torch.testing.assert_close(tensor.detach(), reference["params"][name], rtol=1e-4, atol=1e-5)
    assert (out / "checkpoint").is_dir()
