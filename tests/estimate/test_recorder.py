"""The step recorder of ``torchrig plan``: collectives, operator costs and memory of one step,
recorded in a fake world (torch's fake process group, ``FakeTensorMode``) and — the calibration —
identical to the same step recorded on a real 4-rank gloo group."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchrig.estimate.costs import summarise_collectives
from torchrig.estimate.recorder import StepRecorder, mesh_axes, record_ddp
from torchrig.estimate.step_memory import StepMemory, track_step_memory
from torchrig.testing.pool import WorkerContext

HIDDEN, WIDE, TOKENS = 16, 32, 64  # a batch of 4 x 16 tokens
FLOAT = 4


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(HIDDEN, WIDE)
        self.b = torch.nn.Linear(WIDE, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


def _fake_world(world_size: int) -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def fake_world8() -> Iterator[None]:
    """Rank 0 of a fake world of 8, destroyed whatever the test does."""
    yield from _fake_world(8)


@pytest.fixture
def fake_world4() -> Iterator[None]:
    yield from _fake_world(4)


def _prepared(layout: str, *, on_meta: bool) -> tuple[torch.nn.Module, Any]:
    """The tiny 2-block model of a layout, prepared on the current world (fake or real)."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    if layout == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(Block(), Block()))
        record_ddp(model)
        return model, None
    if layout == "fsdp_tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    elif layout == "hsdp":  # fully_shard on a 2-D mesh: replicate over the first axis, shard over the second
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    with torch.device("meta" if on_meta else "cpu"):
        model = torch.nn.Sequential(Block(), Block())
    for block in model:
        if layout == "fsdp_tp":
            parallelize_module(block, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"] if layout == "fsdp_tp" else mesh)
    fully_shard(model, mesh=mesh["dp"] if layout == "fsdp_tp" else mesh)
    return model, mesh


def _recorded_step(model: torch.nn.Module, mesh: Any) -> tuple[StepRecorder, StepMemory]:
    """One forward, backward and AdamW step, recorded; the model already materialised."""
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(4, TOKENS // 4, HIDDEN)
    with track_step_memory(model, optimizer) as memory, StepRecorder(mesh_axes(mesh) if mesh else None) as recorder:
        model(batch).sum().backward()
        optimizer.step()
    assert memory.result is not None
    return recorder, memory.result


def _fake_step(layout: str) -> tuple[StepRecorder, StepMemory]:
    if layout == "ddp":  # DDP cannot wrap meta parameters: a real tiny model on the fake group
        model, mesh = _prepared(layout, on_meta=False)
        return _recorded_step(model, mesh)
    model, mesh = _prepared(layout, on_meta=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        return _recorded_step(model, mesh)


def _shard_bytes(model: torch.nn.Module) -> int:
    return sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()) * FLOAT


# ------------------------------------------------------------------------ (a) collectives


def test_fsdp_tp_collectives_per_axis_are_the_hand_computed_ones(fake_world8: None) -> None:
    recorder, _ = _fake_step("fsdp_tp")  # dp 4 x tp 2
    block_tp_local = (HIDDEN * WIDE + WIDE) // 2 + (WIDE * HIDDEN) // 2 + HIDDEN  # colwise a, rowwise b (bias whole)
    activation = TOKENS * HIDDEN * FLOAT
    summary = {(s.axis, s.kind): (s.group_size, s.count, s.payload_bytes, s.wire_bytes) for s in recorder.summary()}
    assert summary == {
        # each block's unsharded (tp-local) parameters gathered for forward and again for backward
        ("dp", "all_gather"): (4, 4, 4 * block_tp_local * FLOAT, 4 * block_tp_local * FLOAT * 3 // 4),
        # each block's gradients reduce-scattered once
        ("dp", "reduce_scatter"): (4, 2, 2 * block_tp_local * FLOAT, 2 * block_tp_local * FLOAT * 3 // 4),
        # the row-wise output in each forward; the input gradient of block 2 only (the batch needs none)
        ("tp", "all_reduce"): (2, 3, 3 * activation, 3 * activation),
    }
    phases = [(r.kind, r.phase) for r in recorder.collectives]
    assert phases.count(("all_gather", "forward")) == 2 and phases.count(("reduce_scatter", "backward")) == 2
    # DTensor's local operators are what is counted: 4 tp-local linears forward, 7 backward
    local_linear = 2 * TOKENS * HIDDEN * (WIDE // 2)
    assert recorder.flops_by_phase() == {"forward": 4 * local_linear, "backward": 7 * local_linear, "optimizer": 0}


def test_mesh_axes_names_dimensions_flattened_ones_and_the_world(fake_world8: None) -> None:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    axes = mesh_axes(mesh["tp"])  # a submesh: the root's axes all the same
    assert sorted(axes.values()) == ["dp", "dp_replicate", "dp_shard", "tp"]
    assert axes[mesh.get_group("tp").group_name] == "tp"
    recorder = StepRecorder(axes)
    with recorder:
        dist.all_reduce(torch.ones(8))
        dist.broadcast(torch.ones(4, dtype=torch.float16), src=0, group=mesh.get_group("dp_shard"))
    assert [(r.kind, r.axis, r.group_size, r.payload_bytes, r.wire_bytes) for r in recorder.collectives] == [
        ("all_reduce", "world", 8, 32, 2 * 32 * 7 // 8), ("broadcast", "dp_shard", 2, 8, 8)]


def test_point_to_point_and_barrier_are_recorded_as_pipelines_issue_them(fake_world4: None) -> None:
    with StepRecorder() as recorder:
        dist.send(torch.ones(4), dst=1)
        dist.recv(torch.ones(2), src=1)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(3), 1),
                                        dist.P2POp(dist.irecv, torch.ones(5), 3)])
        for work in works:
            work.wait()
        dist.barrier()
    assert [(r.kind, r.payload_bytes, r.wire_bytes) for r in recorder.collectives] == [
        ("send", 16, 16), ("recv", 8, 8), ("send", 12, 12), ("recv", 20, 20), ("barrier", 0, 0)]


# ------------------------------------------------------------------------ (b) FLOPs


def test_flops_of_a_linear_stack_are_six_n_tokens() -> None:
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32, bias=False) for _ in range(3)])
    params = sum(p.numel() for p in model.parameters())
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        batch = torch.randn(8, 32, requires_grad=True)
        with StepRecorder() as recorder:
            model(batch).sum().backward()
    flops = recorder.flops_by_phase()
    assert flops["forward"] == 2 * params * 8 and flops["backward"] == 4 * params * 8
    forward_mm = [c for c in recorder.op_costs("forward") if c.matmul]
    # three identical layers fold into one record: input, weight and output read or written once each
    assert [(c.name, c.count, c.dtype, c.bytes) for c in forward_mm] == [
        ("mm", 3, "float32", (8 * 32 + 32 * 32 + 8 * 32) * FLOAT)]


def test_identical_layers_fold_into_the_same_operator_records() -> None:
    def recorded(layers: int) -> StepRecorder:
        with torch.device("meta"):
            model = torch.nn.Sequential(*[Block() for _ in range(layers)])
        with FakeTensorMode(allow_non_fake_inputs=True):
            model.to_empty(device="cpu")
            with StepRecorder() as recorder:
                model(torch.randn(4, 16, HIDDEN)).sum().backward()
        return recorder

    two, twelve = recorded(2), recorded(12)
    assert len(twelve.op_costs()) == len(two.op_costs())
    assert twelve.flops_by_phase()["forward"] == 6 * two.flops_by_phase()["forward"]


def test_a_phase_that_is_none_of_the_four_is_refused_by_name() -> None:
    recorder = StepRecorder()
    with pytest.raises(ValueError, match="'warmup' is not one of forward, backward, optimizer, other"):
        recorder.phase = "warmup"
    recorder.phase = "other"
    with recorder:
        torch.ones(2) + 1
    assert list(recorder.flops_by_phase()) == ["other"]


def test_record_ddp_refuses_a_model_that_is_not_ddp() -> None:
    with pytest.raises(TypeError, match="record_ddp needs a DistributedDataParallel model, got Linear"):
        record_ddp(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


# ------------------------------------------------------------------------ (c) memory


def test_memory_categories_are_the_local_shards(fake_world4: None) -> None:
    model, mesh = _prepared("fsdp", on_meta=True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        _, memory = _recorded_step(model, mesh)
    shard = _shard_bytes(model)
    assert shard == 2 * (2 * HIDDEN * WIDE + WIDE + HIDDEN) * FLOAT // 4
    adam_steps = 4 * len(list(model.parameters()))  # one fp32 step counter per parameter
    assert memory.end_by_category["parameters"] == shard
    assert memory.end_by_category["gradients"] == shard
    assert memory.end_by_category["optimizer_state"] == 2 * shard + adam_steps
    assert memory.by_category["parameters"] == shard
    assert memory.by_category["activations"] > 0
    assert memory.peak_bytes == sum(memory.by_category.values())
    assert memory.peak_phase in ("forward", "backward", "optimizer")


# ------------------------------------------------------------------------ (d) real vs fake

LAYOUTS = ("fsdp", "fsdp_tp", "hsdp", "ddp")
EXPECTED_AXES = {
    "fsdp": {("dp", "all_gather"), ("dp", "reduce_scatter")},
    "fsdp_tp": {("dp", "all_gather"), ("dp", "reduce_scatter"), ("tp", "all_reduce")},
    "hsdp": {("dp_shard", "all_gather"), ("dp_shard", "reduce_scatter"), ("dp_replicate", "all_reduce")},
    "ddp": {("world", "all_reduce")},
}


def _real_steps(ctx: WorkerContext) -> dict[str, Any]:
    """On each pool rank: every layout's step recorded on the real gloo group."""
    results = {}
    for layout in LAYOUTS:
        model, mesh = _prepared(layout, on_meta=False)
        recorder, memory = _recorded_step(model, mesh)
        results[layout] = ([r.as_dict() for r in recorder.collectives], memory.as_dict())
    return results


@pytest.fixture(scope="module")
def real_steps(gloo_pool4: Any) -> dict[str, Any]:
    return gloo_pool4.run(_real_steps, timeout=240)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_fake_step_records_what_the_real_one_does(layout: str, real_steps: dict[str, Any]) -> None:
    real_collectives, real_memory = real_steps[layout]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        recorder, memory = _fake_step(layout)
    finally:
        dist.destroy_process_group()
    assert [r.as_dict() for r in recorder.collectives] == real_collectives
    assert {(s.axis, s.kind) for s in summarise_collectives(recorder.collectives)} == EXPECTED_AXES[layout]
    for category in ("parameters", "gradients", "optimizer_state"):
        assert memory.end_by_category[category] == real_memory["end_by_category"][category], category
    assert memory.peak_bytes == pytest.approx(real_memory["peak_bytes"], rel=0.10)
    for category, nbytes in real_memory["by_category"].items():
        assert memory.by_category[category] == pytest.approx(nbytes, rel=0.10, abs=1024), category
