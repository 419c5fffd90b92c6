"""The step-time roofline, checked against hand-computed cases: a matmul-bound and a memory-bound
operator, an all-gather inside a node and across nodes, overlapped vs exposed collectives, the pipeline
bubble, where mesh axes lie, and the errors that name what is wrong."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from torchrig.estimate import step_time
from torchrig.estimate.costs import CollectiveRecord, CollectiveSummary, OpCost
from torchrig.estimate.hardware import gpu_spec, interconnect
from torchrig.estimate.step_time import OverlapAssumptions, Pipeline, axes_spanning_nodes, estimate_step_time
from torchrig.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
H100 = gpu_spec("h100-sxm")  # bf16 989.4 TFLOP/s, HBM 3.35 TB/s, NVLink 450 GB/s each way
IB = interconnect("ib-ndr-400")  # 50 GB/s per GPU each way
BASE, NVLINK_HOP, NET_HOP = 8.4e-6, 3.4e-6, 9.6e-6  # NCCL's ring/simple latencies
PLACED = {"dp_shard": False, "tp": False, "world": False}


def estimate(ops=(), collectives=(), **kwargs):
    kwargs.setdefault("axes_across_nodes", PLACED)
    return estimate_step_time(ops=ops, collectives=collectives, gpu=H100, interconnect=IB, **kwargs)


def test_a_matmul_bound_operator_runs_at_the_achievable_share_of_the_dtype_peak():
    mm = OpCost("aten.mm", flops=10 ** 12, bytes=10 ** 6, dtype="bfloat16", matmul=True, count=2)
    result = estimate([mm])
    assert result.compute_s == pytest.approx(2 * 1e12 / (989.4e12 * 0.75))
    assert result.flops_bound_s == result.compute_s and result.memory_bound_s == 0
    assert result.total_s == result.compute_s and result.exposed_comm_s == 0 and result.bubble_s == 0
    fp8 = estimate([OpCost("aten._scaled_mm", flops=10 ** 12, bytes=10 ** 6, dtype="float8_e4m3fn", matmul=True)])
    assert fp8.compute_s == pytest.approx(1e12 / (1978.9e12 * 0.75))
    fp32 = OpCost("aten.mm", flops=10 ** 12, bytes=0, dtype="torch.float32", matmul=True)
    assert estimate([fp32]).compute_s == pytest.approx(1e12 / (66.9e12 * 0.75))
    assert estimate([fp32], tf32=True).compute_s == pytest.approx(1e12 / (494.7e12 * 0.75))


def test_a_memory_bound_operator_runs_at_the_achievable_share_of_hbm_bandwidth():
    add = OpCost("aten.add", flops=0, bytes=3_350_000_000, dtype="bfloat16", matmul=False, count=3)
    result = estimate([add])
    assert result.compute_s == pytest.approx(3 * 3.35e9 / (3.35e12 * 0.8))
    assert result.memory_bound_s == result.compute_s and result.flops_bound_s == 0
    # a small matmul over a lot of bytes is memory-bound too: the slower of the two bounds
    thin = OpCost("aten.mm", flops=10 ** 9, bytes=10 ** 9, dtype="bfloat16", matmul=True)
    assert estimate([thin]).memory_bound_s == pytest.approx(1e9 / (3.35e12 * 0.8))
    slower = estimate([add], assumptions=OverlapAssumptions(memory_efficiency=0.5))
    assert slower.compute_s == pytest.approx(3 * 3.35e9 / (3.35e12 * 0.5))


def test_an_all_gather_inside_a_node_runs_over_nvlink_and_across_nodes_over_the_interconnect():
    gather = CollectiveSummary(kind="all_gather", axis="dp_shard", group_size=8, count=2, payload_bytes=16 * 10 ** 9,
                               wire_bytes=14 * 10 ** 9)
    no_overlap = OverlapAssumptions(overlap_data_collectives=False)
    intra = estimate(collectives=[gather], assumptions=no_overlap)
    assert intra.comm_s["dp_shard"] == pytest.approx(2 * (BASE + 7 * NVLINK_HOP) + 14e9 / 450e9)
    assert intra.exposed_comm_s == intra.total_s == intra.comm_s["dp_shard"]
    inter = estimate(collectives=[gather], assumptions=no_overlap, axes_across_nodes={"dp_shard": True})
    assert inter.comm_s["dp_shard"] == pytest.approx(2 * (BASE + 7 * NET_HOP) + 14e9 / 50e9)
    assert inter.collectives[0].across_nodes and not intra.collectives[0].across_nodes
    # EFA's 3200 Gb/s is per 8-GPU node: 4 GPUs per node get twice the share each
    efa = estimate_step_time(ops=[], collectives=[gather], gpu=H100, interconnect=interconnect("efa-v2"),
                             axes_across_nodes={"dp_shard": True}, gpus_per_node=4, assumptions=no_overlap)
    assert efa.comm_s["dp_shard"] == pytest.approx(2 * (BASE + 7 * NET_HOP) + 14e9 / 100e9)
    # all-reduce takes 2(n-1) ring steps; a group of one costs nothing
    reduce = CollectiveSummary(kind="all_reduce", axis="tp", group_size=4, count=1, payload_bytes=0, wire_bytes=0)
    alone = CollectiveSummary(kind="all_gather", axis="tp", group_size=1, count=5, payload_bytes=10, wire_bytes=0)
    assert estimate(collectives=[reduce, alone]).comm_s["tp"] == pytest.approx(BASE + 6 * NVLINK_HOP)


def test_data_axis_collectives_hide_behind_compute_but_the_first_gather_and_tensor_parallel_ones_do_not():
    compute = OpCost("aten.mm", flops=int(989.4e12 * 0.75), bytes=0, dtype="bfloat16", matmul=True)  # 1 s
    one_gather = BASE + 7 * NVLINK_HOP + 45e9 / 450e9  # 0.1 s + latency
    gathers = [CollectiveRecord("all_gather", "dp_shard", 8, 0, 45 * 10 ** 9, phase) for phase in
               ("forward", "forward", "backward", "backward")]
    scatter = CollectiveRecord("reduce_scatter", "dp_shard", 8, 0, 45 * 10 ** 9, "backward")
    result = estimate([compute], gathers + [scatter])
    assert result.comm_s["dp_shard"] == pytest.approx(5 * one_gather)
    # hidden: 3 of 4 gathers (0.3 s < 1 s of compute); exposed: the first gather and the (only) scatter
    assert result.exposed_comm_s == pytest.approx(2 * one_gather)
    assert result.total_s == pytest.approx(1.0 + 2 * one_gather)
    exposed_by_record = {(c.kind, c.phase): c.exposed_s for c in result.collectives}
    assert exposed_by_record == pytest.approx({("all_gather", "forward"): one_gather, ("all_gather", "backward"): 0.0,
                                               ("reduce_scatter", "backward"): one_gather})
    # with too little compute, what exceeds it is exposed as well
    short = OpCost("aten.mm", flops=int(989.4e12 * 0.75 / 10), bytes=0, dtype="bfloat16", matmul=True)  # 0.1 s
    starved = estimate([short], gathers + [scatter])
    assert starved.exposed_comm_s == pytest.approx(2 * one_gather + (3 * one_gather - 0.1))
    # tensor-parallel and optimizer-phase collectives are exposed whole
    tp = [CollectiveRecord("all_gather", "tp", 8, 0, 45 * 10 ** 9, "forward") for _ in range(3)]
    norm = CollectiveRecord("all_reduce", "dp_shard", 8, 0, 0, "optimizer")
    exposed = estimate([compute], tp + [norm])
    assert exposed.exposed_comm_s == pytest.approx(3 * one_gather + BASE + 14 * NVLINK_HOP)
    assert exposed.total_s == pytest.approx(1.0 + exposed.exposed_comm_s)


def test_the_pipeline_bubble_idles_pp_minus_one_micro_batch_slots():
    compute = OpCost("aten.mm", flops=int(989.4e12 * 0.75), bytes=0, dtype="bfloat16", matmul=True)  # 1 s
    one_f_one_b = Pipeline(stages=4, microbatches=8)
    assert one_f_one_b.bubble_fraction == pytest.approx(3 / 11)
    result = estimate([compute], pipeline=one_f_one_b)
    assert result.bubble_s == pytest.approx(3 / 8)
    assert result.bubble_s / result.total_s == pytest.approx(3 / 11)
    interleaved = estimate([compute], pipeline=Pipeline(4, 8, virtual_stages=2, schedule="interleaved-1f1b"))
    assert interleaved.bubble_s == pytest.approx(3 / 16)
    assert estimate([compute]).bubble_s == 0
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule 'interleaved-1f1b'"):
        Pipeline(4, 8, virtual_stages=2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zb'; known: 1f1b, gpipe"):
        Pipeline(4, 8, schedule="zb")
    with pytest.raises(ValueError, match=r"Pipeline.microbatches must be >= 1, got 0"):
        Pipeline(4, 0)


def test_tokens_per_second_and_mfu():
    compute = OpCost("aten.mm", flops=int(989.4e12 * 0.75), bytes=0, dtype="bfloat16", matmul=True)  # 1 s
    result = estimate([compute], tokens_per_step=4096, model_flops_per_step=989.4e12 * 0.5)
    assert result.tokens_per_s == pytest.approx(4096)
    assert result.mfu == pytest.approx(0.5)
    as_dict = result.as_dict()
    assert as_dict["tokens_per_s"] == pytest.approx(4096) and as_dict["gpu"] == "h100-sxm"
    assert as_dict["total_s"] == result.total_s and isinstance(as_dict["assumptions"], list)
    assert estimate([compute]).tokens_per_s is None and estimate([compute]).mfu is None


def test_the_mfu_precision_is_a_peak_column_and_mixed_precision_values_map_onto_one():
    assert [step_time.peak_precision(value) for value in ("bf16", "fp16", "fp8", "no")] == ["bf16", "fp16", "fp8",
                                                                                           "fp32"]
    assert step_time.peak_precision("no", tf32=True) == "tf32"
    with pytest.raises(ValueError, match=r"unknown mixed_precision 'fp4'; known: bf16, fp16, fp8, no"):
        step_time.peak_precision("fp4")
    with pytest.raises(ValueError, match=r"precision 'no' is not a peak column \(fp8, bf16, fp16, tf32, fp32\); "
                                         r"map a mixed_precision value with peak_precision\(\)"):
        estimate(precision="no")


def test_the_assumptions_are_stated():
    lines = estimate(pipeline=Pipeline(4, 8)).describe_assumptions()
    text = "\n".join(lines)
    for fragment in ("h100-sxm", "ib-ndr-400", "75% of the dense peak", "80% of HBM", "first all-gather",
                     "exposed", "pipeline bubble (1f1b)", "27.3%", "MFU against the bf16 dense peak, 989.4"):
        assert fragment in text, (fragment, text)
    assert "pipeline bubble" not in "\n".join(estimate().describe_assumptions())


def test_axes_spanning_nodes_follows_the_row_major_mesh():
    assert axes_spanning_nodes((32, 8), ("dp_shard", "tp"), 8) == {"dp_shard": True, "tp": False, "world": True}
    assert axes_spanning_nodes((2, 4), ("dp_shard", "tp"), 8) == {"dp_shard": False, "tp": False, "world": False}
    # tp outermost: its ranks are 8 apart, on different nodes; dp_shard's 8 neighbours share one
    assert axes_spanning_nodes((8, 8), ("tp", "dp_shard"), 8) == {"tp": True, "dp_shard": False, "world": True}
    # HSDP 2 x 4 x tp 2 on 8-GPU nodes: a shard group (stride 2) stays in a node, replicas are 8 apart
    placed = axes_spanning_nodes((2, 4, 2), ("dp_replicate", "dp_shard", "tp"), 8,
                                 flattened={"dp": ("dp_replicate", "dp_shard"), "dp_shard_tp": ("dp_shard", "tp")})
    assert placed == {"dp_replicate": True, "dp_shard": False, "tp": False, "dp": True, "dp_shard_tp": False,
                      "world": True}
    # a group that straddles a node boundary spans nodes even if it is smaller than a node
    assert axes_spanning_nodes((3, 4), ("pp", "tp"), 6)["tp"] is True
    with pytest.raises(ValueError, match=r"flattened axis 'dp' names \['cp'\]"):
        axes_spanning_nodes((2, 2), ("dp_shard", "tp"), 8, flattened={"dp": ("cp",)})
    with pytest.raises(ValueError, match="differ in length"):
        axes_spanning_nodes((2, 2), ("dp_shard",), 8)


def test_errors_name_the_axis_the_operator_and_the_gpu():
    gather = CollectiveSummary(kind="all_gather", axis="cp", group_size=2, count=1, payload_bytes=2, wire_bytes=1)
    with pytest.raises(ValueError, match=r"collective 'all_gather' on axis 'cp': the axis is not placed"):
        estimate(collectives=[gather])
    odd = OpCost("aten.mm", flops=10, bytes=0, dtype="int8", matmul=True)
    with pytest.raises(ValueError, match=r"operator 'aten.mm': no peak rate for operator dtype 'int8'"):
        estimate([odd])
    fp8 = OpCost("aten._scaled_mm", flops=10, bytes=0, dtype="float8_e4m3fn", matmul=True)
    with pytest.raises(ValueError, match=r"operator 'aten._scaled_mm': GPU 'a100-80gb' has no 'fp8'"):
        estimate_step_time(ops=[fp8], collectives=[], gpu=gpu_spec("a100"), interconnect=IB, axes_across_nodes={})
    with pytest.raises(ValueError, match=r"GPU 'v100' has no 'bf16'"):
        estimate_step_time(ops=[], collectives=[], gpu=gpu_spec("v100"), interconnect=IB, axes_across_nodes={})
    unknown_phase = CollectiveRecord("all_gather", "tp", 2, 2, 1, phase="warmup")
    with pytest.raises(ValueError, match=r"collective 'all_gather' on axis 'tp' has phase 'warmup'; known: forward, "):
        estimate(collectives=[unknown_phase])
    unknown_kind = CollectiveSummary(kind="allgather", axis="tp", group_size=2, count=1, payload_bytes=2, wire_bytes=1)
    with pytest.raises(ValueError, match=r"collective kind 'allgather' on axis 'tp' is unknown; known: all_gather, "):
        estimate(collectives=[unknown_kind])
    with pytest.raises(ValueError, match=r"OverlapAssumptions.matmul_efficiency must be in \(0, 1\], got 1.5"):
        OverlapAssumptions(matmul_efficiency=1.5)


def test_the_module_is_torch_free():
    tree = ast.parse(Path(step_time.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "torch" not in imported


def test_the_published_reference_tables_in_the_docs_are_what_the_script_computes():
    """docs/plan.md's predicted-vs-published tables come from benchmarks/plan_reference.py (analytic inputs
    through this roofline); a change to the roofline or the tables that is not carried to the page fails."""
    reference = load_script(ROOT / "benchmarks" / "plan_reference.py")
    text = (ROOT / "docs" / "plan.md").read_text()
    assert reference.published_table() in text and reference.comparison_table() in text, (
        "docs/plan.md's 'Published reference runs' tables are stale: paste `python benchmarks/plan_reference.py`")
    # the analytic model's own arithmetic: Llama-3.1-8B's 8.03B parameters, torchtitan's FLOPs per token
    assert reference.LLAMA_8B.params == pytest.approx(8.03e9, rel=1e-3)
    assert reference.LLAMA_70B.params == pytest.approx(70.55e9, rel=1e-3)
    fsdp_8b = reference.RUNS[0]
    gathered = sum(r.payload_bytes for r in reference.analytic_collectives(fsdp_8b) if r.kind == "all_gather")
    scattered = sum(r.payload_bytes for r in reference.analytic_collectives(fsdp_8b) if r.kind == "reduce_scatter")
    assert gathered == pytest.approx(2 * 2 * reference.LLAMA_8B.params, rel=1e-6)  # 2x the parameters in bf16
    assert scattered == pytest.approx(4 * reference.LLAMA_8B.params, rel=1e-6)  # 1x in fp32
    # the rough eager elementwise count: 144·d bytes per token, block and forward
    assert reference.eager_elementwise_bytes_per_token(reference.LLAMA_8B) == 32 * 144 * 4096
    # T3 computed MFU with 6·N over all parameters: that reproduces its published 58.2%
    a100_8b = next(run for run in reference.RUNS if run.gpu == "a100-80gb" and run.model is reference.LLAMA_8B)
    all_params_flops = 6 * reference.LLAMA_8B.params + 12 * 32 * 4096 * 8192
    assert a100_8b.published_tps * all_params_flops / 312e12 == pytest.approx(a100_8b.published_mfu, abs=5e-4)
