"""Assembling a run from plugins: the exact hook order, and the step plan the hooks decide."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torchrig import hookimpl
from torchrig.host.runtime import build_step_plan, start_run
from torchrig.plugin.hookspecs import HOOK_API_VERSION
from torchrig.plugin.manifest import PluginManifest
from torchrig.plugin.types import Capabilities
from torchrig.testing import HookRecorder, make_host, plugin_distribution, resolved_config


class OwnsEverythingManifest(PluginManifest):
    api_version = HOOK_API_VERSION


class OwnsEverything:
    """A strategy shaped like DeepSpeed: it owns backward, step, accumulation and precision."""

    def __init__(self) -> None:
        self.backward_calls = 0

    @hookimpl
    def torchrig_strategy_capabilities(self, run):
        return Capabilities(owns_precision=True, owns_accumulation=True)

    @hookimpl
    def torchrig_strategy_step_plan(self, run, plan):
        def backward(loss, **kwargs):
            self.backward_calls += 1
            loss.backward(**kwargs)

        plan.set("backward", backward)
        plan.set("no_sync", lambda model: contextlib.nullcontext())


@pytest.fixture
def engine_like(fake_modules):
    fake_modules.add("tr_fake_engine", OwnsEverything=OwnsEverything, Manifest=OwnsEverythingManifest)
    return plugin_distribution("engine-like", "1.0", [("strategy", "enginelike", "tr_fake_engine:OwnsEverything",
                                                       "tr_fake_engine:Manifest")])


SINGLE_PROCESS = {}


def test_exact_hook_order_of_a_single_process_run():
    host = make_host()
    config = resolved_config({"use_cpu": True}, host=host)  # resolving asks the config hooks: before recording
    with HookRecorder(host) as rec:
        run = start_run(host, config, environ=SINGLE_PROCESS)
        plan = build_step_plan(host, run)
    rec.assert_order(
        [
            "torchrig_detect_cluster",
            "torchrig_select_device",
            "torchrig_init_process_group",
            "torchrig_collectives",
            "torchrig_configure",
            "torchrig_strategy_capabilities",
            # Step-plan hooks are called plugin by plugin (to record slot owners), so a stage
            # nobody implements makes no call: `single` installs nothing, `no` precision does.
            "torchrig_precision_step_plan",
        ],
        exact=True,
    )
    # The strategy was asked before the core default; the selected plugins are registered.
    assert rec.calls_of("torchrig_strategy_capabilities")[0].plugins[:1] == ("strategy:single",)
    assert rec.calls_of("torchrig_select_device")[0].plugins == ("device:cpu", "core:process-defaults")
    assert run.device.device == torch.device("cpu")
    assert run.cluster.world_size == 1 and run.cluster.rank == 0
    assert set(plan.owners.values()) == {"core"}


def test_step_plan_hooks_are_not_called_per_step():
    host = make_host()
    run = start_run(host, resolved_config({"use_cpu": True}, host=host), environ=SINGLE_PROCESS)
    plan = build_step_plan(host, run)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookRecorder(host) as rec:
        for _ in range(3):
            with plan.autocast():
                loss = model(torch.randn(8, 4)).pow(2).mean()
            plan.backward(loss)
            assert plan.optimizer_step(optimizer) is True
            plan.zero_grad(optimizer, True)
    assert rec.calls == []


def test_precision_plugin_owns_its_slots_and_fp16_skips_an_overflowing_step():
    host = make_host()
    run = start_run(host, resolved_config({"use_cpu": True, "mixed_precision": "fp16"}, host=host), environ=SINGLE_PROCESS)
    plan = build_step_plan(host, run)
    for slot in ("autocast", "backward", "unscale_gradients", "optimizer_step"):
        assert plan.owners[slot] == "precision:fp16"
    assert plan.owners["zero_grad"] == "core"

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with plan.autocast():
        out = model(torch.randn(8, 4))
    assert out.dtype == torch.float16
    loss = out.float().pow(2).mean()
    plan.backward(loss)
    assert plan.optimizer_step(optimizer) is True

    before = [p.detach().clone() for p in model.parameters()]
    plan.zero_grad(optimizer, True)
    loss = (model(torch.randn(8, 4)) * float("inf")).sum()
    plan.backward(loss)
    assert plan.optimizer_step(optimizer) is False  # inf gradients: the scaler skipped the step
    for old, new in zip(before, model.parameters()):
        assert torch.equal(old, new)


def test_bf16_autocast_on_cpu():
    host = make_host()
    run = start_run(host, resolved_config({"use_cpu": True, "mixed_precision": "bf16"}, host=host), environ=SINGLE_PROCESS)
    plan = build_step_plan(host, run)
    assert plan.owners["autocast"] == "precision:bf16"
    assert plan.owners["backward"] == "core"
    with plan.autocast():
        out = torch.nn.Linear(4, 2)(torch.randn(3, 4))
    assert out.dtype == torch.bfloat16


def test_strategy_that_owns_precision_skips_the_precision_hook(engine_like):
    host = make_host(engine_like)
    config = resolved_config({"strategy": "enginelike", "mixed_precision": "bf16"}, host=host)
    with HookRecorder(host) as rec:
        run = start_run(host, config, environ=SINGLE_PROCESS)
        plan = build_step_plan(host, run)
    assert "torchrig_precision_step_plan" not in rec.names
    rec.assert_order(["torchrig_strategy_capabilities", "torchrig_strategy_step_plan"])
    assert plan.owners["backward"] == "strategy:enginelike"
    assert plan.owners["no_sync"] == "strategy:enginelike"
    assert plan.owners["autocast"] == "core"  # bf16's autocast was not installed
    runtime = host.pm.get_plugin("strategy:enginelike")
    loss = torch.nn.Linear(2, 1)(torch.randn(2, 2)).sum()
    plan.backward(loss)
    assert runtime.backward_calls == 1
    assert run.capabilities.owns_accumulation and run.capabilities.owns_precision


def test_single_strategy_refuses_a_multi_process_job():
    host = make_host()

    class TwoRanks:
        @hookimpl(tryfirst=True)
        def torchrig_detect_cluster(self, environ):
            from torchrig.plugin.types import ClusterInfo

            return ClusterInfo(rank=1, world_size=2, local_rank=1, local_world_size=2)

        @hookimpl(tryfirst=True)
        def torchrig_init_process_group(self, run):
            return True  # this test exercises the strategy's check, not a real group

    host.register(TwoRanks(), "cluster:tworanks")
    run = start_run(host, resolved_config(host=host), environ=SINGLE_PROCESS)
    with pytest.raises(RuntimeError, match="strategy 'single' was selected but this job has 2 processes"):
        build_step_plan(host, run)


def test_step_plan_rejects_unknown_slots_and_non_callables():
    from torchrig.training.step_plan import StepPlanBuilder

    builder = StepPlanBuilder()
    with pytest.raises(KeyError, match="unknown step plan slot 'backwards'"):
        builder.set("backwards", lambda loss: None)
    with pytest.raises(TypeError, match="must be callable"):
        builder.set("backward", None)


@pytest.mark.multiprocess
def test_a_run_still_alive_at_interpreter_exit_is_unconfigured_once(tmp_path):
    """``torchrig_unconfigure``: at ``end_training``, else at exit — never twice, never skipped."""
    marker = tmp_path / "unconfigured"
    script = textwrap.dedent(f"""
        import sys
        from torchrig import hookimpl
        from torchrig.host.runtime import end_run, start_run
        from torchrig.testing import make_host, resolved_config

        class Releases:
            @hookimpl
            def torchrig_unconfigure(self, run):
                with open({str(marker)!r}, "a") as handle:
                    handle.write(run.config["project_config.project_dir"] + "\\n")

        runs = []
        for tag in ("ended", "alive"):
            host = make_host()
            host.register(Releases(), "releases")
            runs.append(start_run(host, resolved_config({{"use_cpu": True, "project_config.project_dir": tag}}, host=host),
                                  environ={{}}))
        end_run(runs[0])
        end_run(runs[0])
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert marker.read_text().splitlines() == ["ended", "alive"]
