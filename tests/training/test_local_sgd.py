"""LocalSGD on two real gloo ranks: independent steps between averages, equal parameters after each
K-th step, the averaging all-reduces counted, no gradient communication in between; refused on a
strategy that shards its parameters."""

from __future__ import annotations

import pytest
import torch
from torchrig.testing.contracts import rank_environment

pytestmark = pytest.mark.multiprocess


def _local_sgd(ctx, steps, local_sgd_steps):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torchrig import Accelerator
    from torchrig.local_sgd import LocalSGD

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True)
        model = torch.nn.Linear(4, 2)
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        gradient_rounds = []
        model.register_comm_hook(None, lambda state, bucket: (gradient_rounds.append(1),
                                                              default_hooks.allreduce_hook(state, bucket))[1])
        all_reduces = []
        real_all_reduce = dist.all_reduce

        def counting_all_reduce(*args, **kwargs):  # a spy: the real collective runs
            all_reduces.append(1)
            return real_all_reduce(*args, **kwargs)

        dist.all_reduce = counting_all_reduce
        generator = torch.Generator().manual_seed(100 + ctx.rank)  # each rank its own data
        per_step = []
        try:
            with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=local_sgd_steps) as local_sgd:
                for _ in range(steps):
                    before = len(all_reduces)
                    accelerator.backward(model(torch.randn(8, 4, generator=generator)).pow(2).mean())
                    optimizer.step()
                    optimizer.zero_grad()
                    local_sgd.step()
                    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                    per_step.append((flat.clone(), len(all_reduces) - before))
            final = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        finally:
            dist.all_reduce = real_all_reduce
        return per_step, final, len(gradient_rounds), local_sgd.num_syncs, accelerator.strategy


def test_parameters_are_averaged_every_k_steps_and_only_then(gloo_pool):
    (steps0, final0, grads0, syncs0, strategy), (steps1, final1, grads1, syncs1, _) = gloo_pool.run(
        _local_sgd, 5, 2, timeout=120)
    assert strategy == "ddp"
    n_params = 2  # weight and bias: one all-reduce each per average
    for step, ((p0, reduces0), (p1, reduces1)) in enumerate(zip(steps0, steps1), start=1):
        if step % 2 == 0:
            assert torch.equal(p0, p1), f"step {step}: parameters differ right after an average"
            assert reduces0 == reduces1 == n_params, step
        else:
            assert not torch.allclose(p0, p1), f"step {step}: ranks should have drifted apart between averages"
            assert reduces0 == reduces1 == 0, step
    assert torch.equal(final0, final1)  # the exit averages the drift of step 5
    assert syncs0 == syncs1 == 3  # steps 2 and 4, and the exit
    assert grads0 == grads1 == 0  # no gradient all-reduce: the steps ran inside no_sync


def _refused_on_fsdp(ctx):
    from torchrig import Accelerator
    from torchrig.local_sgd import LocalSGD

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp")
        model = accelerator.prepare(torch.nn.Linear(4, 2))
        try:
            LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=2)
        except NotImplementedError as error:
            return str(error)
        finally:
            accelerator.end_training()
        return None


def test_refused_where_parameters_are_sharded(gloo_pool):
    for message in gloo_pool.run(_refused_on_fsdp, timeout=120):
        assert message is not None and "'fsdp' does not declare replicated parameters" in message


def test_one_process_counts_steps_and_communicates_nothing():
    from torchrig import Accelerator
    from torchrig.local_sgd import LocalSGD

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=1) as local_sgd:
        local_sgd.step()
        local_sgd.step()
    assert (local_sgd.enabled, local_sgd.num_steps, local_sgd.num_syncs) == (False, 2, 0)
    with pytest.raises(ValueError, match="local_sgd_steps must be a positive number of steps, got 0"):
        LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=0)
    accelerator.end_training()
