"""Contract suites: the behaviour every plugin of a kind must show, as tests to inherit.

A strategy author subclasses :class:`StrategyContract` in their own test module::

    from torchrig.testing.contracts import StrategyContract

    class TestMyStrategy(StrategyContract):
        strategy = "mystrategy"
        world_size = 2

and pytest runs the inherited tests against that strategy: through the real ``Accelerator``, on
the shared 2-rank gloo worker pool (``gloo_pool`` fixture of ``torchrig.testing.pytest_plugin``)
or in-process for ``world_size = 1``. Each rank runs the task functions below (module-level, so
they can be sent to pool workers).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import pytest

def _elastic_environ(rank: int, world_size: int) -> dict[str, str]:
    """The variables torch elastic sets for rank ``rank`` of ``world_size``. The pool's process
    group already exists, so the Accelerator's default process-group setup reuses it and the
    rendezvous address is never contacted."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@contextlib.contextmanager
def rank_environment(rank: int, world_size: int) -> Iterator[None]:
    """Set elastic's variables (and an empty TORCHRIG config home) for one task, then restore.

    Pool workers run many tasks in one interpreter: Accelerators of earlier tasks live in
    reference cycles until collected, and a live one of another strategy would refuse this
    task's (one strategy per process group), so they are collected first."""
    import gc

    gc.collect()
    saved = dict(os.environ)
    for key in [k for k in os.environ if k.startswith("TORCHRIG_")]:
        del os.environ[key]
    home = tempfile.mkdtemp(prefix="torchrig-contract-home-")
    os.environ["TORCHRIG_CONFIG_HOME"] = home
    if world_size > 1:
        os.environ.update(_elastic_environ(rank, world_size))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class _Ctx:
    """The minimal task context for in-process (world size 1) runs."""

    rank, world_size = 0, 1


def _tiny_model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _batch(rank: int, size: int = 8, seed: int = 0) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(size, 6, generator=generator), torch.randint(0, 3, (size,), generator=generator)


def _flat_params(model: Any) -> list[float]:
    """Every parameter as a list of floats; sharded parameters (DTensors) are gathered first."""
    import torch

    def full(p: Any) -> Any:
        return p.full_tensor() if hasattr(p, "full_tensor") else p

    return torch.cat([full(p.detach()).reshape(-1).cpu() for p in model.parameters()]).tolist()


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
    after it they must be equal on every rank."""
    import torch

    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy=strategy, gradient_accumulation_steps=micro_steps, **options)
        model = _tiny_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = accelerator.prepare(model, optimizer)
        start = _flat_params(accelerator.unwrap_model(model))
        trace = []
        for step in range(micro_steps):
            x, y = _batch(accelerator.process_index, seed=step)
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            trace.append((accelerator.sync_gradients, _flat_params(accelerator.unwrap_model(model)) != start))
        return {"trace": trace, "params": _flat_params(accelerator.unwrap_model(model))}


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
        assert all(r["params"] == results[0]["params"] for r in results)

    def test_clip_grad_norm_reports_the_global_norm_and_clips(self, on_ranks: Any) -> None:
        results = on_ranks(task_clip, self.strategy, self.options)
        assert all(r["norm"] > 0.5 for r in results)
        assert all(r["after"] <= 0.5 + 1e-4 for r in results)
        assert all(abs(r["norm"] - results[0]["norm"]) < 1e-4 * results[0]["norm"] for r in results)

    def test_strategy_state_save_load_round_trips(self, on_ranks: Any, tmp_path: Any) -> None:
        assert all(on_ranks(task_save_load, self.strategy, self.options, str(tmp_path / "state")))


__all__ = ["StrategyContract", "rank_environment", "task_accumulate", "task_clip", "task_reference", "task_save_load",
           "task_step"]
