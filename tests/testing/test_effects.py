"""The contract kit's effect assertions (issue 21) observe what ran: each passes on a run that did
the thing and fails, naming what it saw, on one that did not."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchrig.testing.contracts import rank_environment
from torchrig.testing.effects import (
    COLLECTIVE_OPS,
    assert_collectives,
    assert_forward_dtype,
    assert_master_weights,
    assert_modules_converted,
    count_collectives,
    record_forward_dtypes,
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        return self.body(self.conv(x).mean(-1))


def _bf16(model, x):
    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).float().sum().backward()
    return run


def test_forward_dtype_sees_autocast_and_names_the_modules_that_did_not_use_it():
    model, x = Net(), torch.randn(3, 2, 5)
    record = assert_forward_dtype(model, torch.bfloat16, _bf16(model, x))
    assert [(call.module, call.op) for call in record.calls] == [
        ("conv", "aten.convolution.default"), ("body.0", "aten.addmm.default"), ("body.2", "aten.addmm.default")]
    assert record.dtypes("body") == {torch.bfloat16}  # a name selects the module and its children
    with pytest.raises(AssertionError, match=r"3 of 3 compute ops of the model did not run in torch.bfloat16: conv: "):
        assert_forward_dtype(model, torch.bfloat16, lambda: model(x))  # no autocast: fp32


def test_forward_dtype_selects_by_class_or_predicate_and_never_passes_on_nothing():
    model, x = Net(), torch.randn(3, 2, 5)
    with record_forward_dtypes(model) as record:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=True):
            model.body(model.conv(x).mean(-1).float())
        model.body[2](torch.randn(1, 8))  # the last layer alone, outside autocast
    record.assert_dtype(torch.bfloat16, nn.Conv1d)
    assert record.dtypes(lambda name, module: name == "body.2") == {torch.bfloat16, torch.float32}
    with pytest.raises(AssertionError, match="no matmul/convolution/attention op ran in the forward of 'body.1'"):
        record.assert_dtype(torch.bfloat16, "body.1")  # the ReLU computes nothing this looks at
    assert record.select(nn.Linear)[-1].dtypes == (torch.float32,) * 3


class _Float8Matmul(nn.Module):
    """A float8 matmul as a converted layer issues it (torch._scaled_mm with fp32 scales)."""

    def forward(self, a, b):
        one = torch.tensor(1.0)
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def test_a_scaled_matmul_computes_in_its_matrices_dtype_not_its_scales():
    layer = _Float8Matmul()
    a = torch.randn(16, 32).to(torch.float8_e4m3fn)
    b = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
    record = assert_forward_dtype(layer, torch.float8_e4m3fn, lambda: layer(a, b))
    assert [call.op for call in record.calls] == ["aten._scaled_mm.default"]


def test_master_weights_are_the_fp32_tensors_the_optimizer_updates():
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(3, 2, 5)).float().sum().backward()
    optimizer.step()
    assert assert_master_weights(optimizer, torch.float32, model=model) == 6
    low = Net().bfloat16()
    with pytest.raises(AssertionError, match=r"not torch.float32: #0 \(4, 2, 3\) torch.bfloat16"):
        assert_master_weights(torch.optim.SGD(low.parameters(), lr=0.1))
    state = optimizer.state[next(iter(model.parameters()))]
    state["exp_avg"] = state["exp_avg"].bfloat16()
    with pytest.raises(AssertionError, match="#0 state 'exp_avg' torch.bfloat16"):
        assert_master_weights(optimizer)
    copy = [p.detach().clone() for p in Net().parameters()]
    with pytest.raises(AssertionError, match="6 tensor\\(s\\) that are not parameters of Net"):
        assert_master_weights(torch.optim.SGD(copy, lr=0.1), model=model)


def test_modules_converted_counts_instances_or_a_predicate():
    model = Net()
    assert assert_modules_converted(model, nn.Linear, count=2) == ["body.0", "body.2"]
    assert assert_modules_converted(model, lambda m: isinstance(m, nn.Conv1d)) == ["conv"]
    with pytest.raises(AssertionError, match=r"2 module\(s\) converted to Linear, expected 3"):
        assert_modules_converted(model, nn.Linear, count=3)
    with pytest.raises(AssertionError, match="no module of Net was converted to Embedding"):
        assert_modules_converted(model, nn.Embedding)


def test_every_counted_collective_op_exists_in_torch():
    for name in COLLECTIVE_OPS:  # a misspelt name would never be counted
        namespace, op = name.split("::")
        assert hasattr(getattr(torch.ops, namespace), op), name


def test_collective_assertions_name_the_kind_and_refuse_unknown_ones():
    with count_collectives() as counts:
        torch.ones(2).sum()
    assert counts.total == 0 and counts.as_dict() == {}
    assert_collectives(counts, all_reduce=0, total=range(0, 1))
    with pytest.raises(AssertionError, match=r"reduce_scatter: expected 2, issued 0 \(all issued: none\)"):
        assert_collectives(counts, reduce_scatter=2)
    with pytest.raises(TypeError, match="unknown kind.*allreduce"):
        assert_collectives(counts, allreduce=0)
    with torch.autograd.profiler.profile(use_kineto=False):
        with pytest.raises(RuntimeError, match="a profiler is already running"):
            with count_collectives():
                pass


def _collectives(ctx):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as functional

    with rank_environment(ctx.rank, ctx.world_size):
        seen = {}
        with count_collectives() as counts:
            t = torch.ones(4)
            dist.all_reduce(t)
            dist.broadcast(t, 0)
            dist.all_gather_into_tensor(torch.empty(8), t)
            dist.reduce_scatter_tensor(torch.empty(2), t)
            functional.all_reduce(t, "sum", dist.group.WORLD).sum()  # calls c10d::allreduce_ inside: once
        seen["python"] = counts.as_dict()
        model = torch.nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
        for _ in range(2):  # the second iteration rebuilds DDP's buckets: two broadcasts of their layout
            with count_collectives() as counts:
                model(torch.randn(2, 4)).sum().backward()
        seen["rebuild"] = counts.as_dict()
        with count_collectives() as counts:
            model(torch.randn(2, 4)).sum().backward()  # the C++ reducer's bucket all-reduce
        seen["ddp"] = counts.as_dict()
        with count_collectives() as counts, model.no_sync():
            model(torch.randn(2, 4)).sum().backward()
        seen["no_sync"] = counts.as_dict()
        return seen


@pytest.mark.multiprocess
def test_collectives_are_counted_by_kind_from_python_functional_and_cpp_callers(gloo_pool):
    for seen in gloo_pool.run(_collectives, timeout=120):
        assert seen["python"] == {"all_reduce": 2, "broadcast": 1, "all_gather": 1, "reduce_scatter": 1}
        assert seen["rebuild"] == {"broadcast": 2, "all_reduce": 1}
        assert seen["ddp"] == {"all_reduce": 1}
        assert seen["no_sync"] == {}
