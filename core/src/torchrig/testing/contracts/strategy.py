"""The strategy contract: what every strategy plugin must do, as tests to inherit.

A strategy author subclasses :class:`StrategyContract` in their own test module::

    from torchrig.testing.contracts import StrategyContract

    class TestMyStrategy(StrategyContract):
        strategy = "mystrategy"
        world_size = 2
        invalid_configs = [({"mystrategy_config": {"buckets": 0}}, "mystrategy_config.buckets")]

and pytest runs the inherited tests against that strategy: through the real ``Accelerator``, on
the shared 2-rank gloo worker pool (``gloo_pool`` fixture of ``torchrig.testing.pytest_plugin``,
every call with a hard timeout) or in-process for ``world_size = 1``. Each rank runs the task
functions below (module-level, so they can be sent to pool workers).

What is checked: ``prepare`` returns working objects (model, optimizer, dataloader, scheduler);
one step updates the parameters identically on every rank; training equals one process on the
concatenated batch; accumulation steps only at the boundary, after which the ranks agree, and its
micro-steps issue no gradient reduction (``reduces_on_micro_steps``);
``clip_grad_norm_`` returns the norm before clipping and the update is clipped; ``save_state`` →
``load_state`` round-trips parameters and optimizer state; configuration validation accepts the
strategy's defaults and rejects what it cannot do, naming the key.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import pytest

from torchrig.testing.contracts._common import SingleProcess as _Ctx
from torchrig.testing.contracts._common import flat_params as _flat_params
from torchrig.testing.contracts._common import rank_environment
from torchrig.testing.contracts._common import tiny_batch as _batch
from torchrig.testing.contracts._common import tiny_model as _tiny_model


def task_step(ctx: Any, strategy: str, options: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """Train ``steps`` steps on rank-specific data; report parameters and whether they moved."""
    import torch

    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy=strategy, **options)
        model = _tiny_model()
        start = _flat_params(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        for step in range(steps):
            x, y = _batch(accelerator.process_index, seed=step)
            loss = torch.nn.functional.cross_entropy(model(x.to(accelerator.device)), y.to(accelerator.device))
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        params = _flat_params(accelerator.unwrap_model(model))
        return {"params": params, "moved": params != start, "world": accelerator.num_processes,
                "rank": accelerator.process_index, "owners": dict(accelerator.step_plan.owners)}


def task_reference(ctx: Any, world_size: int, steps: int) -> list[float]:
    """One process training on the concatenation of every rank's batch (what data parallelism
    with a mean-reduced loss must equal)."""
    import torch

    model = _tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        batches = [_batch(rank, seed=step) for rank in range(world_size)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return _flat_params(model)


def task_accumulate(ctx: Any, strategy: str, options: Mapping[str, Any], micro_steps: int) -> dict[str, Any]:
    """Accumulate ``micro_steps`` micro-batches: parameters must not move until the last, and
    after it they must be equal on every rank; ``reductions``: the all-reduces and reduce-scatters
    each micro-step issued (:func:`torchrig.testing.effects.count_collectives`)."""
    import torch

    from torchrig import Accelerator
    from torchrig.testing.effects import count_collectives

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy=strategy, gradient_accumulation_steps=micro_steps, **options)
        model = _tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        start = _flat_params(accelerator.unwrap_model(model))
        trace, reductions = [], []
        for step in range(micro_steps):
            x, y = _batch(accelerator.process_index, seed=step)
            with count_collectives() as issued, accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            trace.append((accelerator.sync_gradients, _flat_params(accelerator.unwrap_model(model)) != start))
            reductions.append(issued["all_reduce"] + issued["reduce_scatter"])
        return {"trace": trace, "params": _flat_params(accelerator.unwrap_model(model)), "reductions": reductions}


def task_clip(ctx: Any, strategy: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``clip_grad_norm_`` returns the global norm before clipping, and the step that follows
    applies the clipped gradients. "after" is measured from the update (plain SGD: the change of
    the parameters divided by the learning rate), so it holds whether the core clips the
    gradients in place or the strategy clips inside its own step (DeepSpeed)."""
    import torch

    from torchrig import Accelerator

    lr = 0.1
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy=strategy, **options)
        model = _tiny_model()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=lr))
        before = torch.tensor(_flat_params(accelerator.unwrap_model(model)), dtype=torch.float64)
        x, y = _batch(accelerator.process_index)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y) * 1000)
        norm = accelerator.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()
        updated = torch.tensor(_flat_params(accelerator.unwrap_model(model)), dtype=torch.float64)
        return {"norm": float(norm), "after": float((updated - before).norm() / lr)}


def task_save_load(ctx: Any, strategy: str, options: Mapping[str, Any], directory: str) -> bool:
    """``save_state`` → change everything → ``load_state`` gives back bit-equal parameters and
    optimizer state (through the strategy's checkpoint hooks and the core's commit protocol)."""
    import torch

    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy=strategy, **options)
        model = _tiny_model()
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1))
        x, y = _batch(accelerator.process_index)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        accelerator.save_state(directory, overwrite=True)
        saved = _flat_params(accelerator.unwrap_model(model))
        saved_state = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items() if torch.is_tensor(v)}
        with torch.no_grad():
            for p in accelerator.unwrap_model(model).parameters():
                p.add_(1.0)
        # One more real training step (strategies that own the step need gradients to step).
        x, y = _batch(accelerator.process_index, seed=1)
        accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        accelerator.load_state(directory)
        restored = optimizer.state_dict()["state"][0]
        return saved == _flat_params(accelerator.unwrap_model(model)) and all(
            torch.equal(saved_state[k], restored[k]) for k in saved_state)


def task_prepare(ctx: Any, strategy: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``prepare(model, optimizer, dataloader, scheduler)``: the model still computes, is the
    user's module behind ``unwrap_model``; batches arrive on the device and the ranks together see
    every sample once per epoch; the scheduler steps once per optimizer step."""
    import torch

    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy=strategy, **options)
        model = _tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        data = torch.utils.data.TensorDataset(torch.arange(32, dtype=torch.float32).repeat(6, 1).T,
                                              torch.arange(32) % 3)
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        p_model, p_optimizer, p_loader, p_scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
        seen, devices = [], set()
        for x, y in p_loader:
            devices.add(x.device.type)
            seen.extend(int(v) for v in x[:, 0].tolist())
        x, y = _batch(accelerator.process_index)
        x, y = x.to(accelerator.device), y.to(accelerator.device)
        out = p_model(x)
        accelerator.backward(torch.nn.functional.cross_entropy(out, y))
        lr_before = p_optimizer.param_groups[0]["lr"]
        p_optimizer.step()
        p_scheduler.step()
        p_optimizer.zero_grad()
        everyone = accelerator.gather_for_metrics(torch.tensor(seen, device=accelerator.device))
        return {"shape": tuple(out.shape), "unwrapped": accelerator.unwrap_model(p_model) is model,
                "device": accelerator.device.type, "batch_devices": sorted(devices),
                "samples": sorted(int(v) for v in everyone.reshape(-1).tolist()),
                "lr": (lr_before, p_optimizer.param_groups[0]["lr"])}


def validate_config(strategy: str, config: Mapping[str, Any], directory: pathlib.Path) -> str | None:
    """Resolve a config file selecting ``strategy`` with ``config`` merged in, as ``torchrig config
    validate`` and the launcher do; the error text, or None when it is valid."""
    import yaml

    from torchrig import ConfigError, PluginHost, resolve_config

    path = directory / f"contract-{strategy}.yaml"
    path.write_text(yaml.safe_dump({"strategy": strategy, **config}))
    try:
        resolve_config(PluginHost(), config_file=str(path), default_file=False, warn=False)
    except ConfigError as exc:
        return str(exc)
    return None


class StrategyContract:
    """Behaviour every strategy plugin must show. Subclass and set ``strategy``."""

    #: The strategy plugin's name.
    strategy: ClassVar[str] = ""
    #: Ranks to test on: 1 (in-process) or 2 (the shared gloo worker pool).
    world_size: ClassVar[int] = 2
    #: Extra ``Accelerator(...)`` arguments for every task.
    options: ClassVar[dict[str, Any]] = {}
    #: Tolerance of "data parallelism equals one process on the concatenated batch".
    atol: ClassVar[float] = 1e-5
    #: False for strategies that never all-reduce gradients (local SGD averages parameters
    #: instead): ``clip_grad_norm_`` then reports each rank's own norm, which may differ.
    synchronizes_gradients: ClassVar[bool] = True
    #: True for strategies whose accumulation micro-steps reduce gradients by design (DeepSpeed
    #: ZeRO-2/3 reduce each micro-step's gradients into their partitions). False: a micro-step
    #: issues no all-reduce or reduce-scatter (``no_sync`` took effect), counted from the c10d ops.
    reduces_on_micro_steps: ClassVar[bool] = False
    #: Configurations the strategy cannot run, each with text its error must contain (the key
    #: it names): ``[({"ddp_config": {"comm_hook": "bf16"}}, "ddp_config.comm_hook")]``. Merged
    #: into a config file that selects the strategy; validation must fail before any process
    #: starts. Empty: that test is skipped, saying so.
    invalid_configs: ClassVar[Sequence[tuple[Mapping[str, Any], str]]] = ()

    @pytest.fixture
    def on_ranks(self, request: pytest.FixtureRequest) -> Any:
        if not self.strategy:
            pytest.skip("StrategyContract is abstract: set `strategy` in the subclass")
        if self.world_size == 1:
            return lambda fn, *args, **kwargs: [fn(_Ctx(), *args, **kwargs)]
        pool = request.getfixturevalue("gloo_pool")
        if pool.world_size != self.world_size:
            pytest.skip(f"the shared pool has {pool.world_size} ranks, this contract needs {self.world_size}")
        return lambda fn, *args, **kwargs: pool.run(fn, *args, timeout=120, **kwargs)

    def test_prepare_returns_working_objects(self, on_ranks: Any) -> None:
        results = on_ranks(task_prepare, self.strategy, self.options)
        for result in results:
            assert result["shape"] == (8, 3), "the prepared model must still compute the user's forward"
            assert result["unwrapped"], "unwrap_model(prepared model) must return the user's own module"
            assert result["batch_devices"] == [result["device"]], "batches must arrive on the run's device"
            assert result["samples"] == list(range(32)), "the ranks together must see every sample exactly once"
            assert result["lr"] == (0.1, 0.05), "the scheduler must step once per optimizer step"

    def test_prepare_and_one_step_update_parameters_identically_on_all_ranks(self, on_ranks: Any) -> None:
        results = on_ranks(task_step, self.strategy, self.options, 1)
        assert [r["rank"] for r in results] == list(range(self.world_size))
        assert all(r["world"] == self.world_size for r in results)
        assert all(r["moved"] for r in results), "one optimizer step must change the parameters"
        assert all(r["params"] == results[0]["params"] for r in results), "ranks disagree after one step"

    def test_training_equals_one_process_on_the_concatenated_batch(self, on_ranks: Any) -> None:
        results = on_ranks(task_step, self.strategy, self.options, 3)
        reference = task_reference(_Ctx(), self.world_size, 3)
        for got, want in zip(results[0]["params"], reference):
            assert abs(got - want) <= self.atol, (got, want)

    def test_accumulation_steps_only_at_the_boundary_and_ranks_agree(self, on_ranks: Any) -> None:
        results = on_ranks(task_accumulate, self.strategy, self.options, 3)
        for result in results:
            assert result["trace"] == [(False, False), (False, False), (True, True)], result["trace"]
            if not self.reduces_on_micro_steps:
                assert result["reductions"][:2] == [0, 0], (
                    f"micro-steps must not reduce gradients (no_sync); all-reduces/reduce-scatters issued per "
                    f"micro-step: {result['reductions']}")
            if self.synchronizes_gradients and self.world_size > 1:
                assert result["reductions"][2] > 0, "the optimizer step must reduce the accumulated gradients"
        assert all(r["params"] == results[0]["params"] for r in results)

    def test_clip_grad_norm_reports_the_global_norm_and_clips(self, on_ranks: Any) -> None:
        results = on_ranks(task_clip, self.strategy, self.options)
        assert all(r["norm"] > 0.5 for r in results)
        assert all(r["after"] <= 0.5 + 1e-4 for r in results)
        if self.synchronizes_gradients:
            assert all(abs(r["norm"] - results[0]["norm"]) < 1e-4 * results[0]["norm"] for r in results), (
                "ranks must report the same (global) gradient norm")

    def test_strategy_state_save_load_round_trips(self, on_ranks: Any, tmp_path: Any) -> None:
        assert all(on_ranks(task_save_load, self.strategy, self.options, str(tmp_path / "state")))

    def test_config_selecting_the_strategy_validates(self, tmp_path: pathlib.Path) -> None:
        if not self.strategy:
            pytest.skip("StrategyContract is abstract: set `strategy` in the subclass")
        assert validate_config(self.strategy, {}, tmp_path) is None

    def test_config_validation_rejects_what_it_cannot_do(self, tmp_path: pathlib.Path) -> None:
        if not self.strategy:
            pytest.skip("StrategyContract is abstract: set `strategy` in the subclass")
        if not self.invalid_configs:
            pytest.skip(f"{type(self).__name__} declares no configuration its strategy refuses (invalid_configs)")
        for config, expected in self.invalid_configs:
            error = validate_config(self.strategy, config, tmp_path)
            assert error is not None, f"strategy {self.strategy!r} accepted a configuration it cannot run: {config}"
            assert expected in error, f"the error must name {expected!r}: {error}"


__all__ = ["StrategyContract", "rank_environment", "task_accumulate", "task_clip", "task_prepare", "task_reference",
           "task_save_load", "task_step", "validate_config"]
