"""accelerator.profile() on torch.profiler: ProfileKwargs from kwargs_handlers or the argument, the
Chrome trace read back from where Accelerate writes it, one file per process."""

from __future__ import annotations

import json

import pytest
import torch
from torchrig.testing.contracts import rank_environment


def _events(path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def test_trace_of_kwargs_handler_holds_the_profiled_op_with_shapes(tmp_path):
    from torchrig import Accelerator
    from torchrig.utils import ProfileKwargs

    accelerator = Accelerator(cpu=True, kwargs_handlers=[
        ProfileKwargs(activities=["cpu"], record_shapes=True, output_trace_dir=str(tmp_path / "traces"))])
    with accelerator.profile() as profiler:
        torch.mm(torch.randn(8, 3), torch.randn(3, 5))
    accelerator.end_training()
    matmuls = [event for event in _events(tmp_path / "traces" / "profile_0.json") if event.get("name") == "aten::mm"]
    assert matmuls and matmuls[0]["args"]["Input Dims"] == [[8, 3], [3, 5]]
    assert any(row.key == "aten::mm" for row in profiler.key_averages())


def test_argument_overrides_the_run_options_and_schedule_calls_on_trace_ready(tmp_path):
    from torchrig import Accelerator
    from torchrig.utils import ProfileKwargs

    accelerator = Accelerator(cpu=True, kwargs_handlers=[ProfileKwargs(output_trace_dir=str(tmp_path / "unused"))])
    ready = []
    handler = ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 2}, on_trace_ready=ready.append)
    with accelerator.profile(handler) as profiler:
        for _ in range(4):
            torch.relu(torch.randn(4))
            profiler.step()
    accelerator.end_training()
    assert ready == [profiler]  # one active window of 2 steps after wait + warmup
    assert any(row.key == "aten::relu" for row in profiler.key_averages())
    assert not (tmp_path / "unused").exists()  # the argument replaced the run's options, as in Accelerate


def test_bad_activities_are_refused_with_the_field_named():
    from torchrig.utils import ProfileKwargs

    with pytest.raises(ValueError, match="expected a list of cpu, cuda, xpu, hpu, mtia; got \\['tpu'\\]"):
        ProfileKwargs(activities=["tpu"])


def _profile_two_ranks(ctx, trace_dir):
    from torchrig import Accelerator
    from torchrig.utils import ProfileKwargs

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True)
        with accelerator.profile(ProfileKwargs(output_trace_dir=trace_dir)):
            torch.mm(torch.randn(2, 2), torch.randn(2, 2))
        accelerator.end_training()
        return accelerator.process_index


@pytest.mark.multiprocess
def test_each_process_writes_its_own_trace(gloo_pool, tmp_path):
    assert sorted(gloo_pool.run(_profile_two_ranks, str(tmp_path), timeout=120)) == [0, 1]
    for rank in (0, 1):
        assert any(event.get("name") == "aten::mm" for event in _events(tmp_path / f"profile_{rank}.json"))
