"""The ddp strategy under ``torchrig plan``: the planning stand-in (torchrig_ddp.planning) issues exactly the
collectives a real DistributedDataParallel issues in a steady step — checked against a real DDP on a one-rank
gloo group in this process — and a planned ddp run records its step at a fake world of 64 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torchrig.estimate.plan import PlanInputs, PlanTarget, plan_run, recorded_step
from torchrig.estimate.recorder import StepRecorder
from torchrig.testing import hf_models
from torchrig_ddp.planning import PlannedDistributedDataParallel

WIDTH = 384  # a 384x384 fp32 weight is 576 KiB: several buckets at 1-2 MiB caps


class _OutOfOrder(nn.Module):
    """Layers used in another order than defined (DDP's rebuild follows the gradients, not the definition),
    a bias-free layer, a buffer (broadcast before each forward) and, optionally, an unused layer and bf16
    layers among fp32 ones (DDP buckets each dtype apart)."""

    def __init__(self, unused: bool = False, bf16_layers: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.late = nn.Linear(WIDTH, WIDTH, bias=False)
        self.middle = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, 8)
        self.unused = nn.Linear(WIDTH, WIDTH) if unused else None
        self.register_buffer("scale", torch.ones(WIDTH))
        if bf16_layers:
            self.middle.to(torch.bfloat16)
            self.blocks[1].to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.first(x)) * self.scale
        for layer in (self.middle, *reversed(self.blocks)):
            x = torch.relu(layer(x.to(layer.weight.dtype))).float()
        return self.head(self.late(x))


@pytest.fixture
def one_rank_group():
    """A real one-rank gloo group on an in-memory store (no port, no process)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _step_collectives(model: nn.Module, *, sync: bool = True) -> list[tuple[str, int, str]]:
    """(kind, bytes, phase) of each collective one forward + backward issues, in order."""
    with StepRecorder(count_ops=False) as recorder:
        if sync:
            model(torch.randn(4, WIDTH)).sum().backward()
        else:
            with model.no_sync():
                model(torch.randn(4, WIDTH)).sum().backward()
    return [(record.kind, record.payload_bytes, record.phase) for record in recorder.collectives]


CASES = {  # DDP arguments, comm hook
    "bucket_cap_mb=1": (dict(bucket_cap_mb=1), None),
    "bucket_cap_mb=1, bf16 and fp32 layers": (dict(bucket_cap_mb=1), None),
    "bucket_cap_mb=2, fp16 hook": (dict(bucket_cap_mb=2), default_hooks.fp16_compress_hook),
    "DDP's default caps (1 MiB first bucket, then 25 MiB)": (dict(bucket_cap_mb=None), None),
    "find_unused_parameters, bucket_cap_mb=1": (dict(bucket_cap_mb=1, find_unused_parameters=True), None),
    "static_graph, bucket_cap_mb=2": (dict(bucket_cap_mb=2, static_graph=True), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_stand_in_issues_the_buckets_of_a_real_ddp_in_its_steady_step(one_rank_group, case):
    arguments, hook = CASES[case]
    model = dict(unused=arguments.get("find_unused_parameters", False), bf16_layers="bf16" in case)
    real = nn.parallel.DistributedDataParallel(_OutOfOrder(**model), **arguments)
    if hook is not None:
        real.register_comm_hook(None, hook)
    # the first step reduces one bucket of everything; the next (the third with static_graph) rebuilds the
    # buckets in the order the gradients arrived and broadcasts their indices; every step after is the same
    for _ in range(3):
        real(torch.randn(4, WIDTH)).sum().backward()
    expected = _step_collectives(real)
    logged = real._get_ddp_logging_data()

    stand_in = PlannedDistributedDataParallel(
        _OutOfOrder(**model), compress_to=torch.float16 if hook is not None else None, **arguments)
    first = _step_collectives(stand_in)
    assert first == expected  # the steady step's collectives from the very first step: kind, bytes, phase, order
    assert _step_collectives(stand_in) == expected  # and every step after
    all_reduces = [nbytes for kind, nbytes, _ in expected if kind == "all_reduce"]
    assert len(all_reduces) >= 2 and all(phase == "backward" for kind, _, phase in expected if kind == "all_reduce")
    if model["unused"]:  # DDP does not rebuild: its construction-time buckets, in reverse definition order
        assert not logged["has_rebuilt_buckets"]
        assert stand_in.bucket_bytes == [int(size) for size in str(logged["bucket_sizes"]).split(", ")]
    else:
        assert stand_in.bucket_bytes == [int(size) for size in str(logged["rebuilt_bucket_sizes"]).split(", ")]
        assert stand_in.bucket_indices == [[int(i) for i in bucket.split()]
                                           for bucket in str(logged["rebuilt_per_bucket_param_indices"]).split(", ")]
    if hook is not None:  # compressed to fp16: half the bytes of the fp32 buckets
        assert all_reduces == [nbytes // 2 for nbytes in stand_in.bucket_bytes]
    # no_sync: no gradient communication, on either (the buffer broadcast of the forward stays)
    micro_step = _step_collectives(stand_in, sync=False)
    assert micro_step == _step_collectives(real, sync=False)
    assert not any(kind == "all_reduce" for kind, _, _ in micro_step)


def test_a_parameter_without_gradient_is_the_error_ddp_would_raise_unless_find_unused_parameters(one_rank_group):
    stand_in = PlannedDistributedDataParallel(_OutOfOrder(unused=True), bucket_cap_mb=1)
    with pytest.raises(RuntimeError, match=r"unused\.weight, unused\.bias.*find_unused_parameters: true"):
        stand_in(torch.randn(4, WIDTH)).sum().backward()


def _plan(tmp_path, ddp_config, step=recorded_step):
    hf_models.config("llama", num_hidden_layers=2).to_json_file(str(tmp_path / "config.json"))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"distributed_type": "MULTI_GPU", "ddp_config": ddp_config}))
    report = plan_run(PlanInputs(model=str(tmp_path), seq_len=8,
                                 environment={"TORCHRIG_CONFIG_FILE": str(tmp_path / "run.yaml")}),
                      PlanTarget(8, 8), step=step)
    (plan,) = report.ranks
    return plan


@pytest.mark.parametrize("comm_hook", ["no", "fp16"])
def test_a_planned_ddp_run_at_64_ranks_all_reduces_every_gradient_once_in_its_step(tmp_path, comm_hook):
    compressed = comm_hook == "fp16"  # with the other options that change what DDP sends or holds
    plan = _plan(tmp_path, {"comm_hook": comm_hook, "gradient_as_bucket_view": compressed,
                            "broadcast_buffers": not compressed})
    assert plan.error is None and plan.unsupported is None
    assert plan.layout.strategy == "ddp" and plan.layout.local_parameters == plan.layout.total_parameters
    gradient_bytes = plan.layout.parameter_bytes["float32"]
    (all_reduce,) = [c for c in plan.step.collectives if c.kind == "all_reduce"]
    assert all_reduce.axis == "world" and all_reduce.group_size == 64
    assert all_reduce.payload_bytes == (gradient_bytes if comm_hook == "no" else gradient_bytes // 2)
    assert plan.step.memory.by_category["gradients"] == gradient_bytes
    # the rotary embedding's inv_freq buffer, broadcast from rank 0 before the forward unless turned off
    broadcasts = [c for c in plan.step.collectives if c.kind == "broadcast"]
    assert [c.count for c in broadcasts] == ([] if compressed else [1])


def test_a_planned_ddp_run_with_power_sgd_is_unsupported_by_name(tmp_path):
    plan = _plan(tmp_path, {"comm_hook": "power_sgd"}, step=None)
    assert plan.error is None
    assert plan.unsupported.startswith("strategy 'ddp' with ddp_config.comm_hook 'power_sgd' is not planned")
