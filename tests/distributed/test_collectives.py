"""The default collectives on two real gloo ranks (the shared worker pool)."""

from __future__ import annotations

import pytest
import torch
from torchrig.distributed.collectives import Collectives

pytestmark = pytest.mark.multiprocess


def _gather_uneven(ctx):
    coll = Collectives(world_size=ctx.world_size)
    rows = 3 if ctx.rank == 0 else 1  # uneven first dimension
    tensor = torch.full((rows, 2), float(ctx.rank))
    nested = {"x": tensor, "pair": (torch.tensor(ctx.rank), [torch.ones(ctx.rank + 1)])}
    gathered = coll.gather(nested)
    return (gathered["x"].tolist(), gathered["pair"][0].tolist(), gathered["pair"][1][0].shape[0])


def test_gather_uneven_nested(gloo_pool):
    results = gloo_pool.run(_gather_uneven, timeout=60)
    expected = ([[0.0, 0.0]] * 3 + [[1.0, 1.0]], [0, 1], 3)
    assert results == [expected, expected]


def _reduce_broadcast_objects(ctx):
    coll = Collectives(world_size=ctx.world_size)
    value = torch.tensor([1.0 + ctx.rank, 10.0 * ctx.rank])
    out = {
        "sum": coll.reduce(value, "sum").tolist(),
        "mean": coll.reduce(value, "mean").tolist(),
        "max": coll.reduce(value, "max").tolist(),
        "bcast": coll.broadcast(torch.tensor([ctx.rank + 5.0]), src=1).tolist(),
        "objects": coll.gather_object({"rank": ctx.rank}),
        "flattened": coll.gather_object([ctx.rank, ctx.rank]),
        "object_list": coll.broadcast_object_list([f"from {ctx.rank}"], src=0),
        "input_untouched": value.tolist(),
    }
    coll.barrier()
    return out


def test_reduce_broadcast_and_objects(gloo_pool):
    r0, r1 = gloo_pool.run(_reduce_broadcast_objects, timeout=60)
    assert (r0.pop("input_untouched"), r1.pop("input_untouched")) == ([1.0, 0.0], [2.0, 10.0])
    assert r0 == r1
    assert r0["sum"] == [3.0, 10.0]
    assert r0["mean"] == [1.5, 5.0]
    assert r0["max"] == [2.0, 10.0]
    assert r0["bcast"] == [6.0]
    assert r0["objects"] == [{"rank": 0}, {"rank": 1}]
    assert r0["flattened"] == [0, 0, 1, 1]
    assert r0["object_list"] == ["from 0"]


def test_single_process_collectives_return_input_shapes():
    coll = Collectives(world_size=1)
    t = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(coll.gather(t), t)
    assert coll.gather(torch.tensor(5.0)).shape == (1,)
    assert torch.equal(coll.reduce(t, "mean"), t)
    assert coll.gather_object("a") == ["a"]
    with pytest.raises(ValueError, match="reduction must be one of"):
        coll.reduce(t, "median")


def _shard_through_the_default_hook(ctx):
    from torch.utils.data import DataLoader, TensorDataset
    from torchrig.host.runtime import negotiate_capabilities
    from torchrig.plugin.types import ClusterInfo
    from torchrig.testing import make_host

    host = make_host()
    host.select_auto("device", only="cpu")
    from torchrig.host.run import RunContext
    from torchrig.testing import resolved_config

    run = RunContext(config=resolved_config(host=host), plugins=host,
                     cluster=ClusterInfo(rank=ctx.rank, world_size=ctx.world_size))
    run.device = host.hook.torchrig_select_device(run=run)
    negotiate_capabilities(host, run)
    loader = host.hook.torchrig_prepare_dataloader(
        run=run, dataloader=DataLoader(TensorDataset(torch.arange(12)), batch_size=2, shuffle=True),
        device_placement=True,
    )
    epochs = [torch.cat([b[0] for b in loader]).tolist() for _ in range(2)]
    return epochs


def test_default_dataloader_shards_by_rank_and_reshuffles_each_epoch(gloo_pool):
    (r0_e0, r0_e1), (r1_e0, r1_e1) = gloo_pool.run(_shard_through_the_default_hook, timeout=60)
    assert sorted(r0_e0 + r1_e0) == list(range(12))
    assert sorted(r0_e1 + r1_e1) == list(range(12))
    assert (r0_e0, r1_e0) != (r0_e1, r1_e1)
