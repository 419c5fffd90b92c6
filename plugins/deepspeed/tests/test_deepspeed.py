"""The deepspeed strategy on two real gloo ranks (DeepSpeed's CPU accelerator): ZeRO 0-3 numerics,
accumulation, clipping, bf16, "auto" values, config errors, several engines per run, engine
checkpoints through the core's commit protocol, full weights under ZeRO-3, and a real launch.

The strategy contract (test_*_strategy_contract.py beside this file) covers what every strategy shares; this
module covers what is DeepSpeed's own. Multi-process tests run on the shared 2-rank gloo pool, each
with a hard timeout (DeepSpeed is imported once per pool worker); the pool asserts at the end of the
session that no worker survives. Subprocess tests run in their own session and are waited for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torchrig.testing.contracts import rank_environment
from torchrig.testing.effects import assert_collectives, assert_master_weights, record_forward_dtypes

pytestmark = pytest.mark.multiprocess

TIMEOUT = 180
LR = 1e-2
#: ZeRO-3 keeps parameters below this many elements whole on every rank; 0 partitions even a tiny model.
PARTITION_ALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def batch(rank: int, step: int = 0, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(size, 6, generator=generator), torch.randint(0, 3, (size,), generator=generator)


def flat_state(state: dict) -> torch.Tensor:
    """Every value of a state dict as one fp32 vector (empty on ranks that got ``{}``)."""
    if not state:
        return torch.empty(0)
    return torch.cat([v.detach().float().reshape(-1).cpu() for v in state.values()])


def reference(steps: int, micro: int = 1, clip: float | None = None, seed: int = 0) -> tuple[torch.Tensor, list[float]]:
    """One process on the concatenation of both ranks' batches (what data parallelism must equal);
    with ``micro`` micro-batches per optimizer step, each a separate mean (DeepSpeed divides the
    loss by the accumulation steps). Returns the weights and the pre-clip gradient norms."""
    model = make_model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for step in range(steps):
        for m in range(micro):
            batches = [batch(rank, step * micro + m) for rank in range(2)]
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            (torch.nn.functional.cross_entropy(model(x), y) / micro).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        optimizer.step()
        optimizer.zero_grad()
    return flat_state(model.state_dict()), norms


def accelerator_for(**kwargs):
    import gc

    from torchrig import Accelerator

    gc.collect()  # an earlier task's Accelerator (reference cycles) must not hold the world for its strategy
    return Accelerator(cpu=True, strategy="deepspeed", **kwargs)


def plugin(**fields):
    from torchrig_deepspeed.options import DeepSpeedPlugin

    return DeepSpeedPlugin(**fields)


def _train(ctx, stage, precision="no", micro=1, clip=None, steps=3, ds_json=None, offload=None):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(mixed_precision=precision, gradient_accumulation_steps=micro,
                                      deepspeed_plugin=plugin(zero_stage=stage, hf_ds_config=ds_json,
                                                              offload_optimizer_device=offload))
        model = make_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer = accelerator.prepare(model, optimizer)
        norms, trace = [], []
        for step in range(steps):
            for m in range(micro):
                x, y = batch(accelerator.process_index, step * micro + m)
                with accelerator.accumulate(model):
                    with record_forward_dtypes(model) as record:
                        out = model(x)
                    loss = torch.nn.functional.cross_entropy(out, y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and clip is not None:
                        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), clip)))
                    optimizer.step()
                    optimizer.zero_grad()
                trace.append((accelerator.sync_gradients, model.global_steps))
        record.assert_dtype(torch.bfloat16 if precision == "bf16" else torch.float32)  # what the matmuls ran in
        if stage == 3:  # ZeRO-3 puts its fp32 partitions into the optimizer's groups only during the step
            master = [t.dtype for t in model.optimizer.fp32_partitioned_groups_flat]
        else:  # the flat fp32 partition(s) ZeRO's optimizer steps, and their Adam state
            master = [torch.float32] * assert_master_weights(model.optimizer, torch.float32)
        state = accelerator.get_state_dict(model)
        return {"state": flat_state(state) if state else None, "norms": norms, "trace": trace,
                "loss_dtype": str(loss.dtype), "param_dtype": str(next(accelerator.unwrap_model(model).parameters()).dtype),
                "optimizer": type(optimizer.optimizer).__name__, "engine_optimizer": type(model.optimizer).__name__,
                "owners": dict(accelerator.step_plan.owners), "master": master}


@pytest.mark.parametrize(("stage", "precision", "offload"), [
    (0, "no", None), (1, "no", None), (2, "no", None), (3, "no", None), (2, "bf16", None), (3, "bf16", None),
    (2, "no", "cpu"),  # optimizer state in CPU memory, stepped by the script's torch optimizer
])
def test_zero_stages_match_one_process_on_the_concatenated_batch(gloo_pool, stage, precision, offload):
    results = gloo_pool.run(_train, stage, precision, ds_json=PARTITION_ALL if stage == 3 else None, offload=offload,
                            timeout=TIMEOUT)
    want, _ = reference(3)
    got = results[0]["state"]
    if precision == "bf16":  # bf16 weights in the forward, fp32 master weights in the optimizer
        assert results[0]["param_dtype"] == "torch.bfloat16" and results[0]["loss_dtype"] == "torch.float32"
        torch.testing.assert_close(got, want, atol=5e-2, rtol=0)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    if stage != 3:
        assert torch.equal(results[1]["state"], got)  # every rank holds the same model
    else:
        assert results[1]["state"] is None  # gathered on the main process only
    assert results[0]["optimizer"] == "AdamW"  # the script's optimizer, driven by the engine
    if stage > 0:  # ZeRO keeps fp32 master weights whatever the forward computes in
        assert results[0]["master"] and set(results[0]["master"]) == {torch.float32}
    owners = results[0]["owners"]
    assert {owners[s] for s in ("backward", "optimizer_step", "zero_grad", "clip_grad_norm", "no_sync")} == {
        "strategy:deepspeed"}
    assert owners["autocast"] == "core"  # no autocast: the engine holds low-precision weights itself


def test_accumulation_steps_only_at_boundaries_and_divides_the_loss_once(gloo_pool):
    results = gloo_pool.run(_train, 2, micro=3, steps=2, timeout=TIMEOUT)
    want, _ = reference(2, micro=3)
    torch.testing.assert_close(results[0]["state"], want, atol=1e-5, rtol=1e-4)
    # (sync_gradients, engine optimizer steps) after each micro-step
    assert results[0]["trace"] == [(False, 0), (False, 0), (True, 1), (False, 1), (False, 1), (True, 2)]


def _counts_from_the_deepspeed_config(ctx):
    """No top-level count: the DeepSpeed configuration's (plugin field, then a number in its JSON)
    is what the engine is built with and what accumulate() counts."""
    results = {}
    with rank_environment(ctx.rank, ctx.world_size):
        for where, options in (("field", plugin(gradient_accumulation_steps=3)),
                               ("json", plugin(hf_ds_config={"gradient_accumulation_steps": 3}))):
            accelerator = accelerator_for(deepspeed_plugin=options)
            model = make_model()
            model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
            trace = []
            for step in range(3):
                x, y = batch(ctx.rank, step)
                with accelerator.accumulate(model):
                    accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
                trace.append((accelerator.sync_gradients, model.global_steps))
            results[where] = (accelerator.gradient_accumulation_steps, model.gradient_accumulation_steps(), trace)
            del accelerator, model, optimizer
    return results


def test_the_deepspeed_configs_accumulation_count_is_the_runs(gloo_pool):
    results = gloo_pool.run(_counts_from_the_deepspeed_config, timeout=TIMEOUT)[0]
    for where in ("field", "json"):
        assert results[where] == (3, 3, [(False, 0), (False, 0), (True, 1)]), where


def _collectives_per_micro_step(ctx, stage):
    from torchrig.testing.effects import count_collectives

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(gradient_accumulation_steps=3, deepspeed_plugin=plugin(zero_stage=stage))
        model = make_model()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
        issued = []
        for step in range(6):
            x, y = batch(ctx.rank, step)
            with count_collectives() as counts, accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            issued.append(counts)
        return issued


@pytest.mark.parametrize(("stage", "per_micro_step"), [(0, 0), (1, 0), (2, 1)])
def test_micro_steps_communicate_only_where_zero_partitions_gradients(gloo_pool, stage, per_micro_step):
    """ZeRO-0/1 accumulate full gradients and reduce them at the boundary; ZeRO-2 reduces each
    micro-step's gradients into their partitions during its backward (DeepSpeed's design: the
    partitions are what accumulates), so its micro-steps communicate."""
    for issued in gloo_pool.run(_collectives_per_micro_step, stage, timeout=TIMEOUT):
        for index, counts in enumerate(issued):
            if index % 3 != 2:
                assert_collectives(counts, all_reduce=per_micro_step, total=per_micro_step)
            else:  # the boundary: the gradient reduction (and the global norm), then the updated partitions gathered
                assert_collectives(counts, all_reduce=range(1, 3), all_gather=0 if stage == 0 else 1)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_clip_grad_norm_returns_the_global_norm_and_the_engine_clips(gloo_pool, stage):
    ds_json = PARTITION_ALL if stage == 3 else None
    results = gloo_pool.run(_train, stage, clip=0.05, ds_json=ds_json, timeout=TIMEOUT)
    want, norms = reference(3, clip=0.05)
    assert all(n > 0.05 for n in norms), "the reference must actually clip"
    torch.testing.assert_close(results[0]["state"], want, atol=1e-5, rtol=1e-4)
    for result in results:
        assert result["norms"] == pytest.approx(norms, rel=1e-4)


def _clip_conflict(ctx):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(deepspeed_plugin=plugin(gradient_clipping=1.0))
        model = make_model()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
        accelerator.backward(torch.nn.functional.cross_entropy(model(batch(ctx.rank)[0]), batch(ctx.rank)[1]))
        errors = []
        for call in (lambda: accelerator.clip_grad_norm_(model.parameters(), 0.5),
                     lambda: accelerator.clip_grad_value_(model.parameters(), 0.5),
                     lambda: accelerator.clip_grad_norm_(model.parameters(), 1.0, norm_type=1)):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 -- the message is what is tested
                errors.append(str(exc))
        return errors, float(accelerator.clip_grad_norm_(model.parameters(), 1.0))


def test_clipping_that_contradicts_the_configuration_is_an_error(gloo_pool):
    errors, norm = gloo_pool.run(_clip_conflict, timeout=TIMEOUT)[0]
    assert "max_norm=0.5" in errors[0] and "deepspeed_config.gradient_clipping" in errors[0]
    assert "clip_grad_value_ is not supported" in errors[1] and "gradient_clipping" in errors[1]
    assert "norm_type=2" in errors[2]
    assert norm > 0


# -- "auto" values -------------------------------------------------------------------------------

HF_STYLE = {
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto", "loss_scale": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto",
                                              "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": 4}},
    "zero_optimization": {"stage": "auto", "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def _auto(ctx):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(mixed_precision="bf16", gradient_accumulation_steps=2,
                                      deepspeed_plugin=plugin(hf_ds_config=HF_STYLE, gradient_clipping=0.7))
        model = make_model()
        model.config = type("Config", (), {"hidden_size": 16})()  # as a Hugging Face model declares it
        script_optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, betas=(0.8, 0.9), eps=1e-7)
        data = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randint(0, 3, (40,)))
        loader = torch.utils.data.DataLoader(data, batch_size=5)
        model, optimizer, loader = accelerator.prepare(model, script_optimizer, loader)  # the model is prepared first
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        group = optimizer.param_groups[0]
        return {"micro": model.train_micro_batch_size_per_gpu(), "total": model.train_batch_size(),
                "accumulation": model.gradient_accumulation_steps(), "clipping": model.gradient_clipping(),
                "bf16": model.bfloat16_enabled(), "fp16": model.fp16_enabled(), "stage": model.zero_optimization_stage(),
                "optimizer_is_scripts": optimizer.optimizer is script_optimizer,
                "optimizer": type(optimizer.optimizer).__name__,
                "hyper": (group["weight_decay"], tuple(group["betas"]), group["eps"]),
                "max_lr": list(model.lr_scheduler.max_lrs), "reduce_bucket_size": model.zero_reduce_bucket_size(),
                "engine_steps": model.global_steps}


def test_auto_values_are_filled_from_the_run(gloo_pool):
    result = gloo_pool.run(_auto, timeout=TIMEOUT)[0]
    assert (result["micro"], result["accumulation"], result["total"]) == (5, 2, 20)  # micro × accumulation × 2 ranks
    assert result["clipping"] == 0.7 and result["stage"] == 2
    assert result["bf16"] and not result["fp16"]
    # DeepSpeed built the JSON's AdamW with the script optimizer's hyperparameters
    assert not result["optimizer_is_scripts"] and result["optimizer"] == "AdamW"
    assert result["hyper"] == (0.05, (0.8, 0.9), 1e-7)
    assert result["max_lr"] == [3e-3] and result["reduce_bucket_size"] == 256
    assert result["engine_steps"] == 2  # 20 samples per rank, 5 per micro-batch, 2 micro-batches per step


def test_auto_values_without_a_source_are_errors_naming_the_key():
    from torchrig.errors import ConfigError
    from torchrig_deepspeed.ds_config import engine_config

    def build(ds_json, optimizer=None, scheduler=None):
        return engine_config(plugin(hf_ds_config=ds_json), mixed_precision="no", accumulation_steps=1, world_size=2,
                             micro_batch=None, model=make_model(), optimizer=optimizer, scheduler=scheduler)

    with pytest.raises(ConfigError) as info:
        build({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
               "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
               "zero_optimization": {"round_robin_gradients": "auto"}})
    text = str(info.value)
    assert "'optimizer.params.lr'" in text and "none was passed" in text
    assert "'scheduler.params.warmup_num_steps'" in text and "'zero_optimization.round_robin_gradients'" in text
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="two schedulers"):
        build({"scheduler": {"type": "WarmupLR"}}, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 1))
    built = build({"train_batch_size": 8, "train_micro_batch_size_per_gpu": "auto"})
    assert "train_micro_batch_size_per_gpu" not in built.config and not built.micro_batch_pending  # DeepSpeed derives it
    built = build(None)
    assert built.micro_batch_pending and built.clipping_open  # corrected by the dataloader / clip_grad_norm_
    assert built.config["zero_optimization"]["stage"] == 2 and built.config["zero_allow_untested_optimizer"] is True
    assert built.config["zero_force_ds_cpu_optimizer"] is False


def test_configuration_conflicts_are_one_error_before_any_process_group():
    from torchrig.errors import ConfigError

    ds_json = {"bf16": {"enabled": True}, "train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
               "zero_optimisation": {"stage": 3}}
    with pytest.raises(ConfigError) as info:
        accelerator_for(mixed_precision="fp16", gradient_accumulation_steps=2,
                        deepspeed_plugin=plugin(hf_ds_config=ds_json))
    problems = "\n".join(info.value.problems)
    assert "fp16 contradicts the DeepSpeed config, which enables bf16" in problems
    assert "fp16 needs a CUDA GPU" in problems
    assert "unknown top-level DeepSpeed key 'zero_optimisation'" in problems and "zero_optimization" in problems


def test_launch_refuses_a_conflicting_deepspeed_json_before_starting_workers(tmp_path):
    ds_json = tmp_path / "ds.json"
    ds_json.write_text('{\n  "train_batch_size": 10,\n  "train_micro_batch_size_per_gpu": 4,\n'
                       '  "zero_optimisation": {"stage": 3}\n}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env["TORCHRIG_CONFIG_HOME"] = str(tmp_path / "home")
    result = subprocess.run([sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "2",
                             "--use_deepspeed", "--deepspeed_config_file", str(ds_json), SCRIPT, str(tmp_path)],
                            capture_output=True, text=True, timeout=TIMEOUT, env=env, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"{ds_json}:2" in result.stderr and "train_batch_size = 10 must equal" in result.stderr
    assert f"{ds_json}:4" in result.stderr and "did you mean 'zero_optimization'" in result.stderr
    assert not list(tmp_path.glob("ready-*")), "no worker may start"


# -- several engines ------------------------------------------------------------------------------------


def _two(ctx, entangle):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(deepspeed_plugin=plugin(zero_stage=2))
        student, other = make_model(0), make_model(1)
        opt_a = torch.optim.AdamW(student.parameters(), lr=LR)
        opt_b = torch.optim.AdamW(other.parameters(), lr=LR)
        student, opt_a, other, opt_b = accelerator.prepare(student, opt_a, other, opt_b)
        if entangle:
            x, y = batch(ctx.rank)
            try:
                accelerator.backward(torch.nn.functional.cross_entropy(student(x) + other(x), y))
            except Exception as exc:  # noqa: BLE001 -- the message is what is tested
                return str(exc)
            return None
        for step in range(3):
            x, y = batch(ctx.rank, step)
            for model, optimizer in ((student, opt_a), (other, opt_b)):
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
        return [flat_state(accelerator.get_state_dict(m)) for m in (student, other)], student is not other


def test_two_models_train_as_two_engines(gloo_pool):
    results = gloo_pool.run(_two, False, timeout=TIMEOUT)
    (a, b), distinct = results[0]
    assert distinct
    torch.testing.assert_close(a, reference(3, seed=0)[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(b, reference(3, seed=1)[0], atol=1e-5, rtol=1e-4)
    message = gloo_pool.run(_two, True, timeout=TIMEOUT)[0]
    assert "models #0 (Sequential), #1 (Sequential)" in message and "requires_grad_(False)" in message


# -- checkpoints ------------------------------------------------------------------------------------------


def _steps(accelerator, model, optimizer, scheduler, first, count):
    for step in range(first, first + count):
        x, y = batch(accelerator.process_index, step)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()


def _prepared(stage, ds_json=None):
    accelerator = accelerator_for(deepspeed_plugin=plugin(zero_stage=stage, hf_ds_config=ds_json))
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    return (accelerator, *accelerator.prepare(model, optimizer, scheduler))


def _resume(ctx, directory, stage, async_save=False):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, optimizer, scheduler = _prepared(stage)
        _steps(accelerator, model, optimizer, scheduler, 0, 2)
        engine_saves = []  # files the engine's own checkpoint engine wrote on this thread (none when async)
        own_save = model.checkpoint_engine.save
        model.checkpoint_engine.save = lambda state, path: (engine_saves.append(path), own_save(state, path))[1]
        accelerator.save_state(directory, async_save=async_save)
        model.checkpoint_engine.save = own_save
        _steps(accelerator, model, optimizer, scheduler, 2, 2)  # changes the state an async save still writes
        accelerator._wait_for_checkpoint()
        continued = flat_state(accelerator.get_state_dict(model))
        del accelerator, model, optimizer, scheduler
        accelerator, model, optimizer, scheduler = _prepared(stage)  # a fresh run resumes
        accelerator.load_state(directory)
        lr_after_load = scheduler.get_last_lr()
        _steps(accelerator, model, optimizer, scheduler, 2, 2)
        resumed = flat_state(accelerator.get_state_dict(model))
        return {"equal": torch.equal(continued, resumed) if continued.numel() else None, "lr": lr_after_load,
                "engine_saves": len(engine_saves)}


@pytest.mark.parametrize(("stage", "async_save"), [(2, False), (3, False), (3, True)],
                         ids=["zero2", "zero3", "zero3-async"])
def test_save_state_load_state_resumes_bit_equal(gloo_pool, tmp_path, stage, async_save):
    """``async_save``: the engine's files are copied to CPU buffers at the call and written in the save's
    background half (the engine's own checkpoint engine writes none), while training changes the state."""
    from torchrig.checkpoint.layout import read_manifest

    directory = str(tmp_path / "checkpoint")
    results = gloo_pool.run(_resume, directory, stage, async_save, timeout=TIMEOUT)
    assert results[0]["equal"] is True
    assert all((r["engine_saves"] == 0) == async_save for r in results), results
    assert results[0]["lr"] == [LR * 0.25]  # two applied steps before the save
    files = {entry["path"] for entry in read_manifest(directory)["files"]}
    assert "latest" not in files and not os.path.exists(os.path.join(directory, "latest"))  # DeepSpeed's is never written
    for rank in (0, 1):  # every rank's optimizer partition is committed
        assert f"pytorch_model/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt" in files
    assert "zero_to_fp32.py" in files


def _save_for_world_change(ctx, directory):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator, model, optimizer, scheduler = _prepared(2)
        _steps(accelerator, model, optimizer, scheduler, 0, 1)
        accelerator.save_state(directory)


LOAD_ON_ONE = """
import sys, torch
from torchrig import Accelerator
from torchrig_deepspeed.options import DeepSpeedPlugin
accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
x = torch.randn(4, 6)
accelerator.backward(model(x).sum())
optimizer.step()
print("trained-on-one", model.global_steps)
accelerator.load_state(sys.argv[1], allow_world_size_change=True)
"""


def test_a_world_size_change_is_an_error_pointing_at_the_universal_checkpoint(gloo_pool, tmp_path):
    directory = str(tmp_path / "checkpoint")
    gloo_pool.run(_save_for_world_change, directory, timeout=TIMEOUT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRIG_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", LOAD_ON_ONE, directory], capture_output=True, text=True,
                            timeout=TIMEOUT, env=env, start_new_session=True)
    assert result.returncode != 0
    assert "trained-on-one 1" in result.stdout  # one process trains (a one-rank group, no port)
    assert "saved by 2 processes and this run has 1" in result.stderr
    assert "ds_to_universal" in result.stderr and "load_universal" in result.stderr


SAVE_PLAIN = """
import sys, torch
from torchrig import Accelerator
accelerator = Accelerator(cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
accelerator.save_state(sys.argv[1])
"""

LOAD_UNDER_DEEPSPEED = """
import sys, torch
from torchrig import Accelerator
from torchrig_deepspeed.options import DeepSpeedPlugin
accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
accelerator.load_state(sys.argv[1])
"""


def test_a_checkpoint_of_another_strategy_is_refused_naming_both_layouts(tmp_path):
    directory = str(tmp_path / "checkpoint")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRIG_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    saved, result = (subprocess.run([sys.executable, "-c", script, directory], capture_output=True, text=True,
                                    timeout=TIMEOUT, env=env, start_new_session=True)
                     for script in (SAVE_PLAIN, LOAD_UNDER_DEEPSPEED))
    assert saved.returncode == 0, saved.stderr[-2000:]
    assert result.returncode != 0
    assert "DeepSpeedCheckpointError" in result.stderr
    assert "it was saved by single on 1 process; this run is deepspeed on 1 process" in result.stderr, result.stderr[-2000:]
    assert "load it with the strategy and models it was saved with" in result.stderr


class _WritesDerivedState(torch.nn.Linear):
    """Writes a key into ``state_dict()`` that its load never reads back, derived from its weight — as
    bitsandbytes' 4-bit layers write ``weight.absmax``/``quant_map`` (QLoRA; tests/end_to_end/test_peft_qlora.py)."""

    def __init__(self, *args, derived: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.derived = derived

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight.derived"] = torch.full((2,), self.derived)


def _derived_state(ctx, directory, derived_at_load):
    with rank_environment(ctx.rank, ctx.world_size):
        def prepared(derived):
            accelerator = accelerator_for(deepspeed_plugin=plugin(zero_stage=3, hf_ds_config=PARTITION_ALL))
            torch.manual_seed(0)
            model = torch.nn.Sequential(_WritesDerivedState(6, 16, derived=1.0), torch.nn.Tanh(), torch.nn.Linear(16, 3))
            model[0].derived = derived
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return (accelerator, *accelerator.prepare(model, optimizer, scheduler))

        accelerator, model, optimizer, scheduler = prepared(1.0)
        _steps(accelerator, model, optimizer, scheduler, 0, 2)
        accelerator.save_state(directory)
        _steps(accelerator, model, optimizer, scheduler, 2, 2)
        continued = flat_state(accelerator.get_state_dict(model))
        del accelerator, model, optimizer, scheduler
        accelerator, model, optimizer, scheduler = prepared(derived_at_load)
        try:
            accelerator.load_state(directory)
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            return {"error": str(exc)}
        _steps(accelerator, model, optimizer, scheduler, 2, 2)
        resumed = flat_state(accelerator.get_state_dict(model))
        return {"equal": torch.equal(continued, resumed) if continued.numel() else None}


def test_zero3_load_accepts_a_model_written_key_equal_to_the_live_one_and_names_one_that_differs(gloo_pool, tmp_path):
    """DeepSpeed loads the module strictly; torchrig loads it non-strictly and checks the keys as the core does:
    a key the module writes but never reads back (bitsandbytes' quantization state) passes when it equals the
    live value, and is refused by name when it does not (a checkpoint of another base model)."""
    same = gloo_pool.run(_derived_state, str(tmp_path / "same"), 1.0, timeout=TIMEOUT)
    assert same[0] == {"equal": True}, same[0]
    other = gloo_pool.run(_derived_state, str(tmp_path / "other"), 2.0, timeout=TIMEOUT)
    for result in other:
        assert "0.weight.derived" in result["error"] and "differs from this model's" in result["error"], result


def _save_model(ctx, weights):
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = accelerator_for(deepspeed_plugin=plugin(zero_stage=3, hf_ds_config=PARTITION_ALL))
        model = make_model()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
        for step in range(3):
            x, y = batch(ctx.rank, step)
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        local = [p.numel() for p in accelerator.unwrap_model(model).parameters()]
        written = accelerator.save_model(model, weights)
        return local, written


def test_save_model_under_zero3_gathers_the_real_weights(gloo_pool, tmp_path):
    from safetensors.torch import load_file

    weights = str(tmp_path / "weights")
    results = gloo_pool.run(_save_model, weights, timeout=TIMEOUT)
    assert results[0][0] == [0, 0, 0, 0]  # partitioned: no rank holds a whole parameter
    assert results[0][1] and not results[1][1]  # the main process writes
    plain = make_model(seed=123)
    plain.load_state_dict(load_file(os.path.join(weights, "model.safetensors")))
    torch.testing.assert_close(flat_state(plain.state_dict()), reference(3)[0], atol=1e-5, rtol=1e-4)


# -- launch and isolation ------------------------------------------------------------------------------------

SCRIPT = os.path.join(os.path.dirname(__file__), "launch_scripts", "deepspeed_train.py")
ACCELERATE_DS_FILE = os.path.join(os.path.dirname(__file__), "data", "accelerate_deepspeed_config.yaml")


def test_accelerate_deepspeed_config_trains_an_accelerate_script_under_torchrig_launch(tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRIG_", "DS_ACCELERATOR"))}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    # Accelerate's DEEPSPEED file says 8 GPU processes; the flags make it 2 CPU processes.
    command = [sys.executable, "-m", "torchrig", "launch", "--config_file", ACCELERATE_DS_FILE, "--num_processes", "2",
               "--cpu", "--use_deepspeed", SCRIPT, str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, start_new_session=True,
                            cwd=tmp_path)  # logs under tmp_path/torchrig_logs
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reports = [json.loads((out / f"report-{rank}.json").read_text()) for rank in range(2)]
    for report in reports:
        assert (report["strategy"], report["world"], report["engine"]) == ("deepspeed", 2, "DeepSpeedEngine")
        assert (report["zero_stage"], report["accumulation"], report["engine_accumulation"]) == (2, 2, 2)
        assert (report["micro_batch"], report["clipping"]) == (4, 1.0)
        assert report["optimizer_steps"] == report["engine_steps"] == 4  # 32 samples per rank, 4 × 2 per step
        assert report["resumed"] and report["evaluated"] == 64  # gather_for_metrics: every sample once
        assert report["ds_accelerator"] == "cpu"  # from torchrig_worker_environment
    assert len(reports[0]["losses"]) == 8 and reports[0]["losses"] != reports[1]["losses"]  # each rank its own shard
    weights = load_file(out / "weights" / "model.safetensors")
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for pid in (r["pid"] for r in reports):
        assert not os.path.exists(f"/proc/{pid}"), "a worker survived the launch"


def test_worker_environment_selects_the_cpu_accelerator_only_for_deepspeed(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRIG_", "DS_ACCELERATOR"))}
    env["TORCHRIG_CONFIG_HOME"] = str(tmp_path / "home")
    outputs = {}
    for strategy in ("--use_deepspeed", "--use_fsdp"):
        result = subprocess.run([sys.executable, "-m", "torchrig", "launch", "--dry-run", "--cpu", "--num_processes", "2",
                                 strategy, SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=TIMEOUT,
                                env=env, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        outputs[strategy] = result.stdout
    assert outputs["--use_deepspeed"].count("DS_ACCELERATOR=cpu") == 2  # each rank's environment
    assert "DS_ACCELERATOR" not in outputs["--use_fsdp"]


def test_a_ddp_run_never_imports_deepspeed(tmp_path):
    code = ("import sys, torch; from torchrig import Accelerator; a = Accelerator(cpu=True, strategy='ddp'); "
            "m, o = a.prepare(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1)); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'torchrig_deepspeed')))")
    env = {**os.environ, "TORCHRIG_CONFIG_HOME": str(tmp_path / "home")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert result.returncode == 0, result.stderr
    # Only the torch-free manifest (configuration section) is loaded; the runtime and DeepSpeed are not.
    loaded = json.loads(result.stdout.strip().replace("'", '"'))
    assert "deepspeed" not in loaded and "torchrig_deepspeed.strategy" not in loaded, loaded
    assert "torchrig_deepspeed.manifest" in loaded


@pytest.mark.gpu
def test_gpu_zero3_bf16_with_optimizer_offload(tmp_path):
    """DeepSpeed over NCCL, one GPU per rank, on every visible GPU up to two."""
    ranks = min(2, torch.cuda.device_count())
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHRIG_", "DS_ACCELERATOR"))}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"))
    command = [sys.executable, "-m", "torchrig", "launch", "--num_processes", str(ranks), "--use_deepspeed", "--zero_stage", "3",
               "--mixed_precision", "bf16", "--offload_optimizer_device", "cpu", "--gradient_clipping", "1.0", SCRIPT,
               str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, start_new_session=True,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for report in (json.loads((out / f"report-{rank}.json").read_text()) for rank in range(ranks)):
        assert report["zero_stage"] == 3 and report["resumed"] and report["ds_accelerator"] is None
