"""The fsdp strategy (FSDP2, fully_shard) on two real gloo ranks: sharding, numerics, accumulation,
clipping, precision, wrap policies, checkpoints that reshard, full-weight export.

The strategy contract (test_*_strategy_contract.py beside this file) covers the basics every strategy shares;
this module covers what is FSDP's own. Multi-process tests run on the shared 2-rank gloo pool,
each with a hard timeout; the pool asserts at the end of the session that no worker survives.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torchrig.checkpoint.files import CheckpointWriter
from torchrig.testing.contracts import rank_environment
from torchrig.testing.effects import assert_collectives, assert_master_weights, count_collectives, record_forward_dtypes
from torchrig.testing.models import Block, TinyTransformer

pytestmark = pytest.mark.multiprocess

TIMEOUT = 120


class PlainStack(TinyTransformer):
    """The same network without ``_no_split_modules``."""

    _no_split_modules = None


def make_model(cls: type = TinyTransformer, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return cls()


def batch(rank: int, step: int = 0, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 6, generator=generator), torch.randint(0, 3, (size,), generator=generator)


def full(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).cpu()


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([full(p).reshape(-1).float() for p in model.parameters()])


def accelerator_for(**kwargs):
    import gc

    from torchrig import Accelerator

    gc.collect()  # an earlier task's Accelerator (reference cycles) must not hold the world for its strategy
    return Accelerator(cpu=True, **kwargs)


def fsdp(**fsdp_config):
    from torchrig_fsdp.options import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(**fsdp_config)


# -- numerics ---------------------------------------------------------------------------------


def _train(ctx, strategy, steps, fsdp_config=None, **kwargs):
    with rank_environment(ctx.rank, ctx.world_size):
        options = {"fsdp_plugin": fsdp(**fsdp_config)} if fsdp_config is not None else {}
        accelerator = accelerator_for(strategy=strategy, **options, **kwargs)
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        losses = []
        for step in range(steps):
            x, y = batch(accelerator.process_index, step)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(loss.detach()))
        sharded = [type(p).__name__ for p in model.parameters()]
        mesh = getattr(next(model.parameters()), "device_mesh", None)
        return {"params": flat(accelerator.unwrap_model(model)), "sharded": sharded, "losses": losses,
                "mesh": tuple(mesh.shape) if mesh is not None else None,
                "owners": dict(accelerator.step_plan.owners)}


def _reference(steps):
    """One process on the concatenation of both ranks' batches (what data parallelism must equal)."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        batches = [batch(rank, step) for rank in range(2)]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return flat(model)


def test_fsdp_matches_ddp_and_one_process_and_ranks_hold_one_model(gloo_pool):
    fsdp_results = gloo_pool.run(_train, "fsdp", 3, timeout=TIMEOUT)
    ddp_results = gloo_pool.run(_train, "ddp", 3, timeout=TIMEOUT)
    assert all(kind == "DTensor" for kind in fsdp_results[0]["sharded"])
    assert torch.equal(fsdp_results[0]["params"], fsdp_results[1]["params"])  # gathered: one model
    torch.testing.assert_close(fsdp_results[0]["params"], ddp_results[0]["params"], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fsdp_results[0]["params"], _reference(3), atol=1e-5, rtol=1e-4)
    owners = fsdp_results[0]["owners"]
    assert owners["no_sync"] == owners["clip_grad_norm"] == "strategy:fsdp"
    assert owners["autocast"] == "core"  # no autocast: FSDP2's policy casts


@pytest.mark.parametrize(("strategy", "mesh"), [("SHARD_GRAD_OP", (2,)), ("HYBRID_SHARD", (1, 2)),
                                                ("_HYBRID_SHARD_ZERO2", (1, 2)), ("NO_SHARD", (2, 1))])
def test_every_sharding_strategy_trains_the_same_model(gloo_pool, strategy, mesh):
    results = gloo_pool.run(_train, "fsdp", 2, {"sharding_strategy": strategy}, timeout=TIMEOUT)
    assert results[0]["mesh"] == mesh
    assert torch.equal(results[0]["params"], results[1]["params"])
    torch.testing.assert_close(results[0]["params"], _reference(2), atol=1e-5, rtol=1e-4)


def test_activation_checkpointing_and_forward_prefetch_change_no_numbers(gloo_pool):
    results = gloo_pool.run(_train, "fsdp", 2, {"activation_checkpointing": True, "forward_prefetch": True},
                            timeout=TIMEOUT)
    torch.testing.assert_close(results[0]["params"], _reference(2), atol=1e-5, rtol=1e-4)


# -- the optimizer built before prepare -------------------------------------------------------


def _remap(ctx, step_before):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp")
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        if step_before:  # optimizer state exists before sharding: it is sharded with its parameter
            model(batch(0)[0]).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        before = {name: full(p).clone() for name, p in model.named_parameters()}
        model, optimizer = accelerator.prepare(model, optimizer)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        live = {id(p) for p in model.parameters()}
        x, y = batch(ctx.rank)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        unchanged = [name for name, p in model.named_parameters() if torch.equal(full(p), before[name])]
        state_kinds = {type(v).__name__ for s in optimizer.state.values() for k, v in s.items() if k != "step"}
        return {"held_is_live": held == live, "unchanged": unchanged, "state_kinds": state_kinds}


@pytest.mark.parametrize("step_before", [False, True])
def test_optimizer_built_before_prepare_updates_every_sharded_parameter(gloo_pool, step_before):
    for result in gloo_pool.run(_remap, step_before, timeout=TIMEOUT):
        assert result["held_is_live"], "the optimizer must hold the sharded parameters"
        assert result["unchanged"] == [], f"parameters that did not update: {result['unchanged']}"
        assert result["state_kinds"] == {"DTensor"}


def _late_optimizer(ctx):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp")
        model = make_model()
        stale = torch.optim.Adam(model.parameters(), lr=1e-2)  # built over the parameters before sharding
        model = accelerator.prepare(model)
        try:
            accelerator.prepare(stale)
        except ValueError as exc:
            refused = str(exc)
        else:
            refused = ""
        fresh = accelerator.prepare(torch.optim.Adam(model.parameters(), lr=1e-2))  # the supported order
        return refused, len(fresh.param_groups[0]["params"])


def test_an_optimizer_over_replaced_parameters_prepared_later_is_refused(gloo_pool):
    """Stepping it would train nothing: the model holds new (sharded) parameters now."""
    for refused, held in gloo_pool.run(_late_optimizer, timeout=TIMEOUT):
        assert "holds the parameters TinyTransformer had before it was prepared" in refused
        assert "'fsdp' strategy replaced them" in refused and "accelerator.prepare(model, optimizer)" in refused
        assert held > 0


# -- accumulation and clipping -----------------------------------------------------------------


def _accumulate(ctx, sync_each_batch):
    from torchrig import GradientAccumulationPlugin

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp", gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=3, sync_each_batch=sync_each_batch))
        model = make_model()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        reduced, issued = [], []
        for step in range(3):
            x, y = batch(ctx.rank, step)
            with count_collectives() as counts, accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                reduced.append(all(p.grad is not None for p in model.parameters()))
                optimizer.step()
                optimizer.zero_grad()
            issued.append(counts)
        return reduced, issued, flat(model)


@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_accumulation_reduce_scatters_only_when_syncing(gloo_pool, sync_each_batch):
    (reduced, issued, p0), (_, _, p1) = gloo_pool.run(_accumulate, sync_each_batch, timeout=TIMEOUT)
    # Micro-steps keep unsharded gradients inside FSDP (no reduce-scatter: no sharded .grad yet)
    # unless sync_each_batch asks to reduce every micro-step (less memory, more communication).
    # 4 units (3 blocks and the root) each reduce-scatter once when syncing; every micro-step gathers
    # the 4 in forward and the 3 resharded blocks again in backward.
    for counts in issued[:2]:
        assert_collectives(counts, reduce_scatter=4 if sync_each_batch else 0, all_gather=7, all_reduce=0)
    assert_collectives(issued[2], reduce_scatter=4, all_gather=7, all_reduce=0)
    assert reduced == ([True, True, True] if sync_each_batch else [False, False, True])
    assert torch.equal(p0, p1)
    model = make_model()  # one process, the same three micro-batches of both ranks, one step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.cat([batch(r, step)[0] for r in range(2)])
        y = torch.cat([batch(r, step)[1] for r in range(2)])
        (torch.nn.functional.cross_entropy(model(x), y) / 3).backward()
    optimizer.step()
    torch.testing.assert_close(p0, flat(model), atol=1e-5, rtol=1e-4)


def _clip(ctx, norm_type):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp")
        model = make_model()
        model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = batch(ctx.rank)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y) * 100)
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.5, norm_type=norm_type)
        grads = torch.cat([full(p.grad).reshape(-1) for p in model.parameters()])
        return type(norm).__name__, float(norm), float(torch.linalg.vector_norm(grads, norm_type))


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_is_the_global_norm_over_shards(gloo_pool, norm_type):
    results = gloo_pool.run(_clip, norm_type, timeout=TIMEOUT)
    model = make_model()
    x = torch.cat([batch(r)[0] for r in range(2)])
    y = torch.cat([batch(r)[1] for r in range(2)])
    (torch.nn.functional.cross_entropy(model(x), y) * 100).backward()
    want = float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), norm_type))
    for kind, norm, after in results:
        assert kind == "Tensor"  # a plain tensor, not a DTensor: .item() and logging just work
        assert norm == pytest.approx(want, rel=1e-4)
        assert after == pytest.approx(0.5, rel=1e-3)


# -- precision ------------------------------------------------------------------------------------


def _precision(ctx, precision):
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp", mixed_precision=precision)
        model = make_model()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        for step in range(3):
            x, y = batch(ctx.rank, step)
            with record_forward_dtypes(model) as record:
                out = model(x)
            accelerator.backward(torch.nn.functional.cross_entropy(out, y))
            optimizer.step()
            optimizer.zero_grad()
            record.assert_dtype(dtype)  # every matmul of every block, the embedding and the head
        master = assert_master_weights(optimizer, torch.float32, model=model)  # the sharded fp32 parameters
        extra = [name for answer in accelerator._host.hook.torchrig_checkpoint_state(run=accelerator._run)
                 for name in answer or {}]
        return {"compute": len(record.calls), "master": master, "out": out.dtype,
                "stored": {full(p).dtype for p in model.parameters()},
                "params": flat(model), "owners": dict(accelerator.step_plan.owners), "extra": sorted(extra),
                "skipped": accelerator.optimizer_step_was_skipped}


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_policy_computes_low_keeps_fp32_shards(gloo_pool, precision):
    results = gloo_pool.run(_precision, precision, timeout=TIMEOUT)
    for result in results:
        # each forward's 8 matmuls (embed, 2 per block, head) ran in low precision (observed, not configured)
        assert result["compute"] == 8
        assert result["master"] == 22  # the optimizer steps the model's own fp32 shards (and keeps fp32 state)
        assert result["out"] == torch.float32  # the loss is computed in fp32
        assert result["stored"] == {torch.float32}  # sharded parameters and the optimizer stay fp32
        assert result["owners"]["autocast"] == "core"
    assert torch.equal(results[0]["params"], results[1]["params"])
    torch.testing.assert_close(results[0]["params"], _reference(3), atol=5e-2, rtol=0)
    owners = results[0]["owners"]
    if precision == "fp16":  # a ShardedGradScaler scales the loss and skips overflowing steps
        assert owners["backward"] == owners["optimizer_step"] == owners["unscale_gradients"] == "strategy:fsdp"
        assert results[0]["extra"] == ["scaler"]  # its loss scale is checkpointed
    else:
        assert owners["backward"] == "core" and results[0]["extra"] == []


# -- wrap policies (in-process: choosing blocks needs no process group) ---------------------------


def test_transformer_wrap_uses_classes_then_no_split_modules():
    from torchrig_fsdp.wrapping import wrap_blocks

    model = make_model()
    by_name = wrap_blocks(model, fsdp(auto_wrap_policy="TRANSFORMER_BASED_WRAP", transformer_layer_cls_to_wrap="Block"))
    assert by_name == list(model.blocks)
    assert wrap_blocks(model, fsdp(auto_wrap_policy="TRANSFORMER_LAYER")) == list(model.blocks)  # _no_split_modules
    assert wrap_blocks(model, fsdp(auto_wrap_policy="NO_WRAP")) == []


def test_size_based_wrap_follows_torchs_bottom_up_rule():
    from torchrig_fsdp.wrapping import wrap_blocks

    model = make_model()  # each Block: 16*2 + 16*32+32 + 32*16+16 = 1104 parameters; each Linear in it 544 / 528
    assert wrap_blocks(model, fsdp(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=1000)) == list(model.blocks)
    assert wrap_blocks(model, fsdp(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=500)) == [
        m for b in model.blocks for m in (b.up, b.down)]
    assert wrap_blocks(model, fsdp(auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=0)) == []  # the root only
    assert wrap_blocks(model, fsdp(auto_wrap_policy=lambda module, recurse, nonwrapped_numel: isinstance(module, Block))) \
        == list(model.blocks)


def test_wrap_configuration_errors_name_the_key_and_the_fix():
    from torchrig_fsdp.strategy import FSDPConfigError
    from torchrig_fsdp.wrapping import wrap_blocks

    with pytest.raises(FSDPConfigError, match=r"fsdp_config.transformer_layer_cls_to_wrap: no module of class "
                                              r"'LlamaDecoderLayer' in TinyTransformer; its submodule classes are: "
                                              r"Block, LayerNorm, Linear, ModuleList"):
        wrap_blocks(make_model(), fsdp(transformer_layer_cls_to_wrap=["LlamaDecoderLayer"]))
    with pytest.raises(FSDPConfigError, match=r"fsdp_config.transformer_layer_cls_to_wrap: .* but no classes are given "
                                              r"and PlainStack declares no "
                                              r"_no_split_modules; set fsdp_config.transformer_layer_cls_to_wrap"):
        wrap_blocks(make_model(PlainStack), fsdp(auto_wrap_policy="TRANSFORMER_BASED_WRAP"))


def test_cpu_offload_without_an_accelerator_is_refused_before_training():
    from torchrig.config.resolve import resolve_config
    from torchrig.errors import ConfigError
    from torchrig.testing import make_host

    with pytest.raises(ConfigError, match=r"fsdp_config.cpu_offload.*uses the CPU.*set cpu_offload: false"):
        resolve_config(make_host(), arguments={"strategy": "fsdp", "use_cpu": True, "fsdp_config": {"cpu_offload": True}},
                       environ={}, flags={}, default_file=False)


def _wrapped(ctx, fsdp_config):
    from torch.distributed.fsdp import FSDPModule

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp", fsdp_plugin=fsdp(**fsdp_config))
        model = accelerator.prepare(make_model(PlainStack))
        return sorted(name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule))


def test_prepare_shards_each_block_and_the_root(gloo_pool):
    names = gloo_pool.run(_wrapped, {"transformer_layer_cls_to_wrap": "Block"}, timeout=TIMEOUT)[0]
    assert names == ["<root>", "blocks.0", "blocks.1", "blocks.2"]
    # Nothing configured and no _no_split_modules: the root alone (said once in the log).
    assert gloo_pool.run(_wrapped, {}, timeout=TIMEOUT)[0] == ["<root>"]


# -- starting weights ---------------------------------------------------------------------------


def _start(ctx, fsdp_config, meta_on_rank1):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp", fsdp_plugin=fsdp(**fsdp_config))
        if meta_on_rank1 and ctx.rank == 1:
            with torch.device("meta"):
                model = make_model(seed=ctx.rank)
        else:
            model = make_model(seed=ctx.rank)  # different weights on each rank
        model = accelerator.prepare(model)
        return flat(model)


def test_sync_module_states_and_cpu_ram_efficient_loading_start_from_rank0(gloo_pool):
    rank0 = flat(make_model(seed=0))
    for config, meta in (({}, False), ({"cpu_ram_efficient_loading": True}, True)):
        for params in gloo_pool.run(_start, config, meta, timeout=TIMEOUT):
            assert torch.equal(params, rank0), config
    unsynced = gloo_pool.run(_start, {"sync_module_states": False}, False, timeout=TIMEOUT)
    assert not torch.equal(unsynced[0], rank0)  # each rank kept a piece of its own weights


# -- metrics, unwrap, full state ------------------------------------------------------------------


def _metrics_and_state(ctx):
    from torch.distributed.fsdp import FSDPModule
    from torch.utils.data import DataLoader, TensorDataset

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp")
        model, loader = accelerator.prepare(make_model(), DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
        seen = torch.cat([accelerator.gather_for_metrics(b) for (b,) in loader]).tolist()
        state = accelerator.get_state_dict(model)
        unwrapped = accelerator.unwrap_model(model)
        return {"seen": sorted(seen), "keys": sorted(state), "plain": all(type(v) is torch.Tensor for v in state.values()),
                "devices": {v.device.type for v in state.values()}, "unwrapped_is_model": unwrapped is model,
                "fsdp_module": isinstance(unwrapped, FSDPModule), "full": {k: v.clone() for k, v in state.items()}}


def test_gather_for_metrics_unwrap_model_and_full_state_dict_on_rank0(gloo_pool):
    r0, r1 = gloo_pool.run(_metrics_and_state, timeout=TIMEOUT)
    assert r0["seen"] == r1["seen"] == list(range(10))
    assert r0["unwrapped_is_model"] and r0["fsdp_module"]  # FSDP2 shards the user's own module in place
    reference = make_model()
    assert r0["keys"] == sorted(reference.state_dict()) and r0["plain"] and r0["devices"] == {"cpu"}
    plain = make_model()
    plain.load_state_dict(r0["full"])  # the gathered weights load into the plain, unwrapped model
    assert torch.equal(flat(plain), flat(reference))
    assert r1["keys"] == []  # gathered on rank 0 only


# -- checkpoints ----------------------------------------------------------------------------------


def _trained(accelerator, steps=2, cls=TinyTransformer):
    model = make_model(cls)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for step in range(steps):
        x, y = batch(accelerator.process_index, step)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _optimizer_state(model, optimizer):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True) if dist.is_initialized() else None
    state = get_optimizer_state_dict(model, optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer,
                                     options=options)["state"]
    return {f"{name}.{key}": value.clone().float() for name, entry in sorted(state.items()) for key, value in entry.items()}


def _save(ctx, directory, state_dict_type):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp", fsdp_plugin=fsdp(state_dict_type=state_dict_type))
        model, optimizer = _trained(accelerator)
        if accelerator.is_main_process:
            os.makedirs(directory, exist_ok=True)
        accelerator.wait_for_everyone()
        writer = CheckpointWriter(directory, accelerator.process_index)
        returned = accelerator._host.hook.torchrig_save_strategy_state(run=accelerator._run, prepared=accelerator._models,
                                                                       directory=directory, writer=writer)
        written = [record.path for record in writer.records(returned)]
        return {"written": sorted(written), "params": flat(model), "optimizer": _optimizer_state(model, optimizer)}


def _load(ctx, directory, state_dict_type="SHARDED_STATE_DICT"):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp", fsdp_plugin=fsdp(state_dict_type=state_dict_type))
        model, optimizer = _trained(accelerator, steps=0)
        accelerator._host.hook.torchrig_load_strategy_state(run=accelerator._run, prepared=accelerator._models,
                                                            directory=directory, manifest={}, allow_pickle=False)
        return {"params": flat(model), "optimizer": _optimizer_state(model, optimizer)}


class _Solo:
    rank, world_size = 0, 1


def test_sharded_state_saved_on_two_ranks_loads_on_one_and_back(gloo_pool, tmp_path):
    two = str(tmp_path / "two")
    saved = gloo_pool.run(_save, two, "SHARDED_STATE_DICT", timeout=TIMEOUT)
    # Each rank reports exactly the files it wrote; rank 0 also DCP's metadata.
    assert saved[0]["written"] == ["optimizer_0/.metadata", "optimizer_0/__0_0.distcp",
                                   "pytorch_model_fsdp_0/.metadata", "pytorch_model_fsdp_0/__0_0.distcp"]
    assert saved[1]["written"] == ["optimizer_0/__1_0.distcp", "pytorch_model_fsdp_0/__1_0.distcp"]
    one = _load(_Solo(), two)  # this process, no process group: 2 -> 1
    assert torch.equal(one["params"], saved[0]["params"])
    assert one["optimizer"].keys() == saved[0]["optimizer"].keys()
    for key, value in saved[0]["optimizer"].items():
        assert torch.equal(one["optimizer"][key], value), key

    single = str(tmp_path / "one")  # 1 -> 2
    os.makedirs(single)
    solo = _save(_Solo(), single, "SHARDED_STATE_DICT")
    assert solo["written"] == ["optimizer_0/.metadata", "optimizer_0/__0_0.distcp", "pytorch_model_fsdp_0/.metadata",
                               "pytorch_model_fsdp_0/__0_0.distcp"]
    for result in gloo_pool.run(_load, single, timeout=TIMEOUT):
        assert torch.equal(result["params"], solo["params"])
        for key, value in solo["optimizer"].items():
            assert torch.equal(result["optimizer"][key], value), key


def test_full_state_dict_type_writes_gathered_files_on_rank0_only(gloo_pool, tmp_path):
    directory = str(tmp_path / "full")
    saved = gloo_pool.run(_save, directory, "FULL_STATE_DICT", timeout=TIMEOUT)
    assert saved[0]["written"] == ["optimizer.bin", "pytorch_model_fsdp.bin"] and saved[1]["written"] == []
    weights = torch.load(os.path.join(directory, "pytorch_model_fsdp.bin"), weights_only=True)
    plain = make_model()
    plain.load_state_dict(weights)  # a full state dict of the user's model
    assert torch.equal(flat(plain), saved[0]["params"])
    for result in gloo_pool.run(_load, directory, "SHARDED_STATE_DICT", timeout=TIMEOUT):  # read by what is there
        assert torch.equal(result["params"], saved[0]["params"])
        for key, value in saved[0]["optimizer"].items():
            assert torch.equal(result["optimizer"][key], value), key


def _stateless_optimizer_round_trip(ctx, directory, state_dict_type):
    """SGD without momentum keeps no tensors: a full optimizer state holds only hyperparameters
    (torch's set_optimizer_state_dict cannot distribute it: "Expected device to be set")."""
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp", fsdp_plugin=fsdp(state_dict_type=state_dict_type))
        model = make_model()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for step in range(2):
            x, y = batch(accelerator.process_index, step)
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        accelerator.save_state(directory)
        saved = flat(accelerator.unwrap_model(model))
        optimizer.param_groups[0]["lr"] = 0.5  # changed after the save: the load must bring 0.1 back
        x, y = batch(accelerator.process_index, 5)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        moved = not torch.equal(flat(accelerator.unwrap_model(model)), saved)
        accelerator.load_state(directory)
        result = {"moved": moved, "restored": torch.equal(flat(accelerator.unwrap_model(model)), saved),
                  "lr": optimizer.param_groups[0]["lr"]}
        accelerator.end_training()
        return result


@pytest.mark.parametrize("state_dict_type", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_an_optimizer_without_tensor_state_saves_and_loads(gloo_pool, tmp_path, state_dict_type):
    results = gloo_pool.run(_stateless_optimizer_round_trip, str(tmp_path / "ckpt"), state_dict_type, timeout=TIMEOUT)
    assert results == [{"moved": True, "restored": True, "lr": 0.1}] * 2


def _refuse_and_wrap(ctx, directory):
    from torchrig_fsdp.checkpoint import FSDPCheckpointError

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp", fsdp_plugin=fsdp(state_dict_type="SHARDED_STATE_DICT"))
        _trained(accelerator, steps=0)
        hook, run, prepared = accelerator._host.hook, accelerator._run, accelerator._models
        messages = []
        writer = CheckpointWriter(directory, accelerator.process_index)
        for call in (lambda: hook.torchrig_save_strategy_state(run=run, prepared=prepared, directory=directory,
                                                               writer=writer),
                     lambda: hook.torchrig_load_strategy_state(run=run, prepared=prepared, directory=directory,
                                                               manifest={}, allow_pickle=False)):
            try:
                call()
            except FSDPCheckpointError as exc:  # an Exception, not DCP's BaseException
                messages.append(str(exc))
        return messages


def test_checkpoint_errors_are_exceptions_naming_the_place(gloo_pool, tmp_path):
    directory = tmp_path / "bad"
    (directory / "pytorch_model_fsdp_0").mkdir(parents=True)
    (directory / "pytorch_model_fsdp_0" / ".metadata").write_bytes(b"not a pickle")
    for save_error, load_error in gloo_pool.run(_refuse_and_wrap, str(directory), timeout=TIMEOUT):
        assert "cannot save the model 0" in save_error and "not empty" in save_error  # never mix shards
        assert "loading the model 0 with torch.distributed.checkpoint" in load_error
        assert str(directory / "pytorch_model_fsdp_0") in load_error and "rank 0: AssertionError: metadata" in load_error


def test_merge_weights_turns_a_sharded_checkpoint_into_safetensors(gloo_pool, tmp_path):
    from safetensors.torch import load_file

    directory = str(tmp_path / "ckpt")
    saved = gloo_pool.run(_save, directory, "SHARDED_STATE_DICT", timeout=TIMEOUT)
    out = tmp_path / "weights"
    command = [sys.executable, "-m", "torchrig", "merge-weights", directory, str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(out / "model.safetensors")]
    plain = make_model(seed=123)
    plain.load_state_dict(load_file(out / "model.safetensors"))
    assert torch.equal(flat(plain), saved[0]["params"])
    again = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT)
    assert again.returncode == 2 and "already exist; pass --overwrite" in again.stderr


def test_merge_weights_explains_a_checkpoint_without_fsdp_state(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    result = subprocess.run([sys.executable, "-m", "torchrig", "merge-weights", str(tmp_path), str(tmp_path / "o")],
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 2
    assert "holds no fsdp model state" in result.stderr and "model.safetensors" in result.stderr


def test_help_lists_plugin_commands_without_importing_torch():
    code = ("import sys; from torchrig.cli.main import build_parser; text = build_parser().format_help(); "
            "print('merge-weights' in text, 'torchrig-fsdp' in text, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT)
    assert result.stdout.split() == ["True", "True", "False"], result.stdout + result.stderr


def test_a_ddp_run_never_imports_the_fsdp_runtime():
    code = ("import sys, torch; from torchrig import Accelerator; a = Accelerator(cpu=True, strategy='ddp'); "
            "a.prepare(torch.nn.Linear(2, 2)); print(sorted(m for m in sys.modules if m.startswith('torchrig_fsdp')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT,
                            env={**os.environ, "TORCHRIG_CONFIG_HOME": "/nonexistent-torchrig-home"})
    assert result.returncode == 0, result.stderr
    # The manifest only (describing the plugin, with the torch-free names and style names it declares): not its
    # options (by reference) nor its runtime.
    assert result.stdout.strip() in ("[]", "['torchrig_fsdp', 'torchrig_fsdp.constants', 'torchrig_fsdp.hf_style_names', "
                                           "'torchrig_fsdp.manifest']")


# -- through the Accelerator: save_state / load_state (the core's commit protocol) and save_model --


def _save_state_and_model(ctx, checkpoint, weights):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp", fsdp_plugin=fsdp(state_dict_type="SHARDED_STATE_DICT"))
        model, _ = _trained(accelerator)
        accelerator.save_state(checkpoint)
        accelerator.save_model(model, weights)
        return flat(model)


def _load_state(ctx, checkpoint):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(strategy="fsdp")
        model, _ = _trained(accelerator, steps=0)
        accelerator.load_state(checkpoint, allow_world_size_change=True)
        return flat(model)


def test_save_state_on_two_ranks_resumes_on_one_and_save_model_loads_into_a_plain_model(gloo_pool, tmp_path):
    from safetensors.torch import load_file

    checkpoint, weights = str(tmp_path / "checkpoint"), str(tmp_path / "weights")
    params = gloo_pool.run(_save_state_and_model, checkpoint, weights, timeout=TIMEOUT)[0]
    files = sorted(os.listdir(os.path.join(checkpoint, "pytorch_model_fsdp_0")))
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert torch.equal(_load_state(_Solo(), checkpoint), params)  # 2 -> 1, committed checkpoint
    plain = make_model(seed=7)
    plain.load_state_dict(load_file(os.path.join(weights, "model.safetensors")))
    assert torch.equal(flat(plain), params)


# -- a real launch ----------------------------------------------------------------------------------

SCRIPT = os.path.join(os.path.dirname(__file__), "launch_scripts", "fsdp_train.py")
SEED_FSDP_FILE = os.path.join(os.path.dirname(__file__), "data", "accelerate_fsdp_config.yaml")


def _launch(tmp_path, *flags, ranks=2):
    import json

    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torchrig", "launch", *flags, SCRIPT, str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, start_new_session=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [json.loads((out / f"report-{rank}.json").read_text()) for rank in range(ranks)]
    return out, reports


def test_seed_fsdp_config_with_launch_flags_trains_on_two_cpu_processes(tmp_path):
    from safetensors.torch import load_file

    # Accelerate's FSDP file says 8 GPU processes in bf16; the flags make it 2 CPU processes.
    out, reports = _launch(tmp_path, "--config_file", SEED_FSDP_FILE, "--num_processes", "2", "--cpu")
    for report in reports:
        assert (report["strategy"], report["world"], report["mixed_precision"]) == ("fsdp", 2, "bf16")
        assert report["param_type"] == "DTensor" and report["sharding"] == "FULL_SHARD"
    assert reports[0]["losses"][-1] < reports[0]["losses"][0]
    # FULL_STATE_DICT in the file: rank 0 wrote the gathered state; the weights load into a plain model.
    assert os.path.isfile(out / "checkpoint" / "pytorch_model_fsdp.bin")
    weights = load_file(out / "weights" / "model.safetensors")
    assert {"embed.weight", "blocks.0.mix.weight", "head.bias"} <= set(weights)
    for pid in (r["pid"] for r in reports):
        assert not os.path.exists(f"/proc/{pid}"), "a worker survived the launch"


@pytest.mark.gpu
def test_gpu_bf16_policy_and_cpu_offload_on_up_to_two_gpus(tmp_path):
    """FSDP over NCCL, one GPU per rank: DTensor shards, the bf16 policy and CPU offload (which
    the CPU tier refuses). With one GPU, offloading is refused at one process (nothing is sharded)."""
    ranks = min(2, torch.cuda.device_count())
    flags = ("--num_processes", str(ranks), "--use_fsdp", "--mixed_precision", "bf16", "--fsdp_offload_params", "true",
             "--fsdp_state_dict_type", "SHARDED_STATE_DICT")
    if ranks == 1:  # nothing to shard, so nothing to offload: refused, never silently ignored
        with pytest.raises(AssertionError, match=r"cpu_offload .*this run has one process"):
            _launch(tmp_path, *flags, ranks=ranks)
        return
    _, reports = _launch(tmp_path, *flags, ranks=ranks)
    for report in reports:
        assert (report["strategy"], report["world"], report["mixed_precision"]) == ("fsdp", ranks, "bf16")
        assert report["param_type"] == "DTensor"
        assert report["device"] == "cpu"  # offloaded shards live in CPU memory between steps
