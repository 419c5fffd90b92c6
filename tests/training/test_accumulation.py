"""A strategy's accumulation count goes through ``Capabilities.accumulation_steps``: the core adopts it
into its own gradient state unless the run set a count, and the strategy reads the result
(``run.stash[ACCUMULATION_STATE]``) — no plugin writes the core's accumulation state."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
from collections.abc import Iterator

import pytest
import torch
import torchrig.accelerator.accelerator as accelerator_module
from torchrig import Accelerator, GradientAccumulationPlugin
from torchrig.host.discovery import installed_distributions
from torchrig.host.plugin_host import PluginHost
from torchrig.plugin.hookspecs import HOOK_API_VERSION
from torchrig.plugin.manifest import PluginManifest
from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import ACCUMULATION_STATE, Capabilities, PreparedModel
from torchrig.testing import plugin_distribution

DECLARED = 3


class EngineManifest(PluginManifest):
    api_version = HOOK_API_VERSION


class EngineBuiltWithItsOwnCount:
    """Shaped like DeepSpeed: its configuration fixes the micro-steps its engine counts."""

    def __init__(self) -> None:
        self.built_with: list[int] = []

    @hookimpl
    def torchrig_strategy_capabilities(self, run):
        return Capabilities(owns_accumulation=True, accumulation_steps=DECLARED)

    @hookimpl
    def torchrig_prepare_model(self, run, model, optimizers, schedulers, device_placement):
        self.built_with.append(run.stash[ACCUMULATION_STATE].num_steps)  # what the engine is built with
        return PreparedModel(model=model, unwrapped=model, optimizers=list(optimizers), schedulers=list(schedulers))

    @hookimpl
    def torchrig_strategy_step_plan(self, run, plan):
        plan.set("no_sync", lambda model: contextlib.nullcontext())


@pytest.fixture
def engine_strategy(fake_modules, monkeypatch, tmp_path) -> Iterator[None]:
    """Accelerators in this test see the installed plugins plus the ``declares-steps`` strategy."""
    for key in [k for k in os.environ if k.startswith("TORCHRIG_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path / "home"))
    fake_modules.add("tr_fake_declares_steps", Engine=EngineBuiltWithItsOwnCount, Manifest=EngineManifest)
    dist = plugin_distribution("declares-steps", "1.0", [("strategy", "declares-steps", "tr_fake_declares_steps:Engine",
                                                          "tr_fake_declares_steps:Manifest")])
    monkeypatch.setattr(accelerator_module, "PluginHost",
                        functools.partial(PluginHost, [*installed_distributions(), dist]))
    gc.collect()  # an earlier test's Accelerator must not hold the world for its strategy
    yield
    gc.collect()  # nor may this test's hold it for the next test's (tests/training/ runs test_compile_check.py next)


def _prepared(**kwargs):
    accelerator = Accelerator(cpu=True, strategy="declares-steps", **kwargs)
    model = torch.nn.Linear(4, 2)
    model, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    engine = accelerator._host.pm.get_plugin("strategy:declares-steps")
    return accelerator, model, engine


def test_the_core_adopts_the_count_a_strategy_declares_and_the_strategy_builds_with_it(engine_strategy):
    accelerator, model, engine = _prepared()
    assert accelerator.gradient_accumulation_steps == DECLARED
    assert engine.built_with == [DECLARED]
    syncs = []
    for _ in range(2 * DECLARED):
        with accelerator.accumulate(model):
            syncs.append(accelerator.sync_gradients)
    assert syncs == [False, False, True] * 2  # accumulate() counts what the engine counts


@pytest.mark.parametrize("setting", [{"gradient_accumulation_steps": 2},
                                     {"gradient_accumulation_plugin": GradientAccumulationPlugin(num_steps=2)}],
                         ids=["argument", "plugin"])
def test_a_count_the_run_set_stands_and_the_strategy_builds_with_it(engine_strategy, setting):
    accelerator, _, engine = _prepared(**setting)
    assert accelerator.gradient_accumulation_steps == 2
    assert engine.built_with == [2]
