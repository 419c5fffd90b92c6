"""The ddp strategy on two real gloo ranks: communication, hooks, data and metrics."""

from __future__ import annotations

import pytest
import torch
from torchrig.testing.contracts import rank_environment
from torchrig.testing.effects import assert_collectives, assert_compiled

pytestmark = pytest.mark.multiprocess


def _accumulation_comm(ctx, micro_steps, width, bucket_cap_mb):
    """The collectives each micro-step issues (counted from the c10d ops, DDP's C++ reducer included)."""
    from torchrig import Accelerator
    from torchrig.testing.effects import count_collectives
    from torchrig_ddp.options import DistributedDataParallelKwargs

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=micro_steps,
                                  kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=bucket_cap_mb)])
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                    torch.nn.ReLU(), torch.nn.Linear(width, 4))
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
        per_backward = []
        for cycle in range(3):
            for micro in range(micro_steps):
                with count_collectives() as counts, accelerator.accumulate(model):
                    x = torch.randn(8, width)
                    accelerator.backward(model(x).pow(2).mean())
                    optimizer.step()
                    optimizer.zero_grad()
                per_backward.append(counts)
        # DDP's own record of its rebuilt buckets: how many depends on the order gradients became ready
        # (a layer's weight before or after its bias), which autograd does not fix.
        rebuilt = model._get_ddp_logging_data()["rebuilt_bucket_sizes"]
        return accelerator.strategy, per_backward, len(str(rebuilt).split(","))


# 25 MiB holds the whole model: one bucket. 1 MiB splits the 2 MiB model (two or three buckets) once DDP
# rebuilt its buckets in the order gradients arrived (at the first synchronized forward after the first
# synchronized step).
@pytest.mark.parametrize(("width", "bucket_cap_mb", "buckets"), [(128, 25, range(1, 2)), (512, 1, range(2, 4))])
def test_accumulation_all_reduces_each_bucket_once_per_optimizer_step_and_never_on_micro_steps(
        gloo_pool, width, bucket_cap_mb, buckets):
    for strategy, per_backward, rebuilt in gloo_pool.run(_accumulation_comm, 4, width, bucket_cap_mb, timeout=120):
        assert rebuilt in buckets  # bucket_cap_mb took effect
        assert strategy == "ddp"  # the default for two processes
        for index, counts in enumerate(per_backward):
            if index % 4 != 3:  # a micro-step: no gradient communication at all
                assert_collectives(counts, all_reduce=0, reduce_scatter=0, all_gather=0)
        assert_collectives(per_backward[3], all_reduce=1, total=1)  # before the rebuild: one bucket
        assert_collectives(per_backward[11], all_reduce=rebuilt, total=rebuilt)  # one per bucket


def _gather_for_metrics(ctx):
    from torch.utils.data import DataLoader, TensorDataset
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True)
        loader = accelerator.prepare(DataLoader(TensorDataset(torch.arange(10)), batch_size=4))
        seen, local = [], []
        for (batch,) in loader:
            local.append(batch.shape[0])
            seen.append(accelerator.gather_for_metrics(batch))
        objects = accelerator.gather_for_metrics([f"r{ctx.rank}"], use_gather_object=True)
        return torch.cat(seen).tolist(), local, objects


def test_gather_for_metrics_counts_each_sample_exactly_once_on_an_uneven_last_batch(gloo_pool):
    for seen, local, objects in gloo_pool.run(_gather_for_metrics, timeout=120):
        assert local == [4, 4]  # even batches: every rank gets the same number and size of batches
        assert sorted(seen) == list(range(10))  # the 6 repeated samples of the last batch are dropped
        assert objects == ["r0", "r1"]


def _comm_hook_and_frozen(ctx, hook):
    from torch.nn.parallel import DistributedDataParallel
    from torchrig import Accelerator
    from torchrig_ddp.options import DistributedDataParallelKwargs

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=hook, bucket_cap_mb=1)])
        torch.manual_seed(0)
        student, teacher = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2).requires_grad_(False)
        student, teacher, optimizer = accelerator.prepare(student, teacher, torch.optim.SGD(student.parameters(), lr=0.1))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(ctx.rank))
        accelerator.backward((student(x) - teacher(x)).pow(2).mean())
        optimizer.step()
        return (isinstance(student, DistributedDataParallel), isinstance(teacher, DistributedDataParallel),
                accelerator.unwrap_model(student).weight.detach().tolist(), accelerator.config.source("ddp_config.comm_hook").layer.name)


@pytest.mark.parametrize("hook", ["fp16", "power_sgd"])
def test_comm_hooks_and_a_frozen_teacher(gloo_pool, hook):
    (s0, t0, w0, source), (s1, t1, w1, _) = gloo_pool.run(_comm_hook_and_frozen, hook, timeout=120)
    assert (s0, t0) == (True, False)  # the frozen teacher is not wrapped (DDP refuses it)
    assert w0 == w1  # compressed gradients still give one model
    assert source == "ARGUMENT"


def test_bf16_compression_is_refused_before_training_without_cuda():
    from torchrig.config.resolve import resolve_config
    from torchrig.errors import ConfigError
    from torchrig.testing import make_host

    with pytest.raises(ConfigError, match="ddp_config.comm_hook.*bf16 gradient compression needs CUDA"):
        resolve_config(make_host(), arguments={"strategy": "ddp", "use_cpu": True, "ddp_config": {"comm_hook": "bf16"}},
                       environ={}, flags={}, default_file=False)


def _collectives_under_ddp(ctx):
    from torch.utils.data import DataLoader, TensorDataset
    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True)
        ragged = torch.full((ctx.rank + 1, 2), float(ctx.rank))
        padded = accelerator.pad_across_processes(ragged, dim=0, pad_index=-1)
        with accelerator.split_between_processes(list(range(5)), apply_padding=True) as share:
            mine = share
        total = accelerator.reduce(torch.tensor([1.0 + ctx.rank]), "mean")
        first = []
        with accelerator.main_process_first():
            first.append(ctx.rank)
        if ctx.rank == 1:
            accelerator.set_trigger()
        triggered = accelerator.check_trigger()

        # Uneven inputs: rank 1 has one batch more; Join keeps DDP's collectives from hanging.
        model = torch.nn.Linear(4, 1)
        model, optimizer, loader = accelerator.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1),
            DataLoader(TensorDataset(torch.randn(6, 4, generator=torch.Generator().manual_seed(0))), batch_size=2))
        steps = 0
        with accelerator.join_uneven_inputs([model], even_batches=False):
            for (x,) in loader:
                accelerator.backward(model(x).sum())
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
        return padded.tolist(), mine, total.item(), triggered, steps, loader.even_batches


def test_accelerator_collectives_and_join_uneven_inputs_on_two_ranks(gloo_pool):
    (p0, s0, m0, t0, n0, e0), (p1, s1, m1, t1, n1, e1) = gloo_pool.run(_collectives_under_ddp, timeout=120)
    assert p0 == [[0.0, 0.0], [-1.0, -1.0]] and p1 == [[1.0, 1.0], [1.0, 1.0]]
    assert s0 == [0, 1, 2] and s1 == [3, 4, 4]  # contiguous shares, the shorter one padded
    assert m0 == m1 == 1.5
    assert t0 is True and t1 is True
    assert (n0, n1) == (2, 1)  # 3 batches of 2 over 2 ranks, no padding: rank 0 gets two
    assert e0 is True and e1 is True  # restored after the block


def _timeout_for_later_groups(ctx):
    import datetime

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torchrig import Accelerator, InitProcessGroupKwargs

    with rank_environment(ctx.rank, ctx.world_size):
        Accelerator(cpu=True, kwargs_handlers=[InitProcessGroupKwargs(timeout=900)])
        group = dist.new_group(ranks=[0, 1])
        dist.barrier(group=group)  # the new group works
        return c10d._get_default_timeout(dist.Backend.GLOO) == datetime.timedelta(seconds=900)


def test_the_configured_timeout_applies_to_groups_created_later(gloo_pool):
    assert gloo_pool.run(_timeout_for_later_groups, timeout=120) == [True, True]


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.linear(x))


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _compiled_under_ddp(ctx, backend, regional):
    import warnings

    from torch.nn.parallel import DistributedDataParallel
    from torchrig import Accelerator
    from torchrig.config.options import TorchDynamoPlugin
    from torchrig.testing.effects import count_collectives, count_compilation

    torch._dynamo.reset()
    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, dynamo_plugin=TorchDynamoPlugin(backend=backend, use_regional_compilation=regional))
        torch.manual_seed(0)
        model, optimizer = accelerator.prepare(_Stack(), torch.optim.SGD(_Stack().parameters(), lr=0.01))
        with warnings.catch_warnings(record=True) as caught, count_compilation() as compiled:
            warnings.simplefilter("always")
            for _ in range(2):  # the compile check's steps (it profiles them itself)
                accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
                optimizer.step()
                optimizer.zero_grad()
        with count_collectives() as issued:  # after the check: the compiled model still all-reduces
            accelerator.backward(model(torch.randn(4, 8)).pow(2).mean())
            optimizer.step()
        wrapped = isinstance(getattr(model, "_orig_mod", model), DistributedDataParallel)
        weight = accelerator.unwrap_model(model).head.weight.detach().clone()
        return {"report": accelerator.compile_report(), "compiled": compiled, "issued": issued, "ddp": wrapped,
                "weight": weight, "warnings": [str(w.message) for w in caught if "torch.compile" in str(w.message)]}


@pytest.mark.parametrize(("backend", "regional", "names"), [
    ("aot_eager", False, ["DistributedDataParallel"]),
    ("eager", True, ["DistributedDataParallel.module.blocks.0", "DistributedDataParallel.module.blocks.1"])])
def test_compiled_code_runs_under_ddp_on_every_rank(gloo_pool, backend, regional, names):
    results = gloo_pool.run(_compiled_under_ddp, backend, regional, timeout=120)
    for result in results:
        assert result["ddp"]  # compiled around the DDP wrapper, or its blocks compiled in place inside it
        modules = result["report"]["modules"]
        assert sorted(modules) == names, modules
        assert all(stats["compiled"] and stats["compiled_calls"] == stats["calls"] == 2 for stats in modules.values())
        assert_compiled(result["compiled"])
        assert_collectives(result["issued"], all_reduce=1, reduce_scatter=0)  # one bucket, synchronized
        if regional:
            assert result["warnings"] == []
        else:  # torch keeps DDP's own forward (_pre_forward, _inside_ddp_forward) out of the graph, by design
            assert len(result["warnings"]) == 1 and "graph break(s)" in result["warnings"][0], result["warnings"]
    assert torch.equal(results[0]["weight"], results[1]["weight"])  # the ranks stayed in step
