"""The plan's calibration on 4 CPU ranks (issue 36, "Calibration, measured" (1)): for each layout, what
``plan_run`` predicts at a fake world of 4 against the same configuration trained for real on 4 gloo
ranks through torchrig's own ``Accelerator`` and strategy.

Both sides read the same run file (``TORCHRIG_CONFIG_FILE``), build the same tiny transformers Llama
from the same config.json (real weights on the real ranks, the meta device in the plan), use the plan's
AdamW and the same batch shape, and record a steady step (the plan creates the optimizer state with one
unrecorded step on zero gradients; the real ranks train two unrecorded steps, which also lets a pipeline
exchange its stages' shapes and DDP rebuild its buckets) with the same recorder
(:class:`~torchrig.estimate.recorder.StepRecorder`) and memory tracker
(:func:`~torchrig.estimate.step_memory.track_step_memory`). The real step is written as a training loop
writes it (``model(input_ids=..., labels=...).loss``, ``accelerator.backward``, ``optimizer.step``), not
with the plan's own ``fake_step``, so a difference between the planned and the real path shows.

Asserted per layout, on each planned rank (rank 0; and the last pipeline stage's first rank for PP):
collective summaries equal exactly (kind, axis, group size, count, payload and wire bytes), FLOPs per
phase equal, peak memory and each category within 10%. Measured (torch 2.13, transformers 5.24, CPU),
predicted / measured: FSDP2, FSDP2×TP and HSDP 1.000 on the peak and on every category (equal to the
byte); PP×DP peak 1.038 on rank 0 (258,184 / 248,840 B) and 1.009 on rank 2 (277,784 / 275,224 B), every
category equal but activations, 1.081 and 1.055: under ``FakeTensorMode`` transformers cannot tell that
the position ids of a pipeline stage (no cache) are not packed (``find_packed_sequence_indices``), so the
planned stage builds a causal mask and repeats K/V where the real one calls SDPA with ``is_causal`` and
``enable_gqa``; and the real tracker sees the first stage's gradient receive buffers (allocated by the
warm-up step) only once they are used, the plan from their allocation. DDP: collectives and FLOPs equal,
peak 0.925 (568,952 / 615,420 B) but its split differs (:data:`KNOWN_MEMORY_DIFFERENCES`, an expected
failure that fails when fixed). The numbers are in docs/plan.md, "Calibration on 4 CPU ranks".
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import yaml
from torchrig.accelerator import Accelerator
from torchrig.estimate.memory_model import resolve_model
from torchrig.estimate.plan import PLAN_OPTIMIZERS, PlanInputs, PlanReport, PlanTarget, plan_run, recorded_step
from torchrig.estimate.recorder import StepRecorder, mesh_axes
from torchrig.estimate.step_memory import track_step_memory
from torchrig.testing import hf_models
from torchrig.testing.contracts import rank_environment
from torchrig.testing.pool import WorkerContext

WORLD, BATCH, SEQ, OPTIMIZER = 4, 4, 8, "adamw"
WARM_UP_STEPS, MEASURED_STEPS = 2, 5
TIMEOUT = 300

#: layout -> its run file's contents. PP × DP is planned on rank 0 and on rank 2 (the last stage's first rank).
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp"},
    "fsdp": {"strategy": "fsdp", "parallelism_config": {"dp_shard_size": 4}},
    "fsdp_tp": {"strategy": "fsdp", "parallelism_config": {"dp_shard_size": 2, "tp_size": 2}},
    "hsdp": {"strategy": "fsdp", "parallelism_config": {"dp_replicate_size": 2, "dp_shard_size": 2}},
    "pp_dp": {"strategy": "fsdp", "parallelism_config": {"pp_size": 2, "dp_shard_size": 2}},
}
#: Memory differences between a layout's plan and its real step, found by this test and not fixed here.
KNOWN_MEMORY_DIFFERENCES = {
    "ddp": "the ddp plugin's planning stand-in now holds its buckets' bytes from the first forward, as the reducer does "
           "from construction, yet its peak falls later in backward (every gradient ready, the batch's activations "
           "partly freed) than the real reducer's, which copies each gradient into its bucket as it is ready: the "
           "totals agree within 10%, the split between gradients, activations and temporaries does not",
}


@pytest.fixture(scope="module")
def run_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The model's config.json (directory ``"model"``) and one run file per layout."""
    root = tmp_path_factory.mktemp("calibration")
    model = root / "model"
    model.mkdir()
    hf_models.config("llama", num_hidden_layers=2).to_json_file(str(model / "config.json"))
    files = {"model": str(model), "home": str(root / "home")}
    os.makedirs(files["home"])
    for layout, config in LAYOUTS.items():
        path = root / f"{layout}.yaml"
        path.write_text(yaml.safe_dump(config))
        files[layout] = str(path)
    return files


def _environment(files: dict[str, str], layout: str) -> dict[str, str]:
    return {"TORCHRIG_CONFIG_FILE": files[layout], "TORCHRIG_CONFIG_HOME": files["home"]}


@pytest.fixture(scope="module")
def predictions(run_files: dict[str, str]) -> dict[str, PlanReport]:
    """Each layout planned at a fake world of 4 (one machine of 4 processes)."""
    return {layout: plan_run(PlanInputs(model=run_files["model"], batch_size=BATCH, seq_len=SEQ, optimizer=OPTIMIZER,
                                        environment=_environment(run_files, layout)),
                             PlanTarget(1, WORLD), recorded_step)
            for layout in LAYOUTS}


def _why_unplanned(report: PlanReport) -> str | None:
    """Why a layout has no prediction to compare (a rank's error or unsupported note), or None."""
    for plan in report.ranks:
        if plan.error or plan.unsupported or plan.step is None:
            return f"rank {plan.rank}: {plan.error or plan.unsupported or 'no step recorded'}"
    return None


def _measured_step(files: dict[str, str], layout: str) -> list[dict[str, Any]]:
    """Steady training steps of ``layout`` on this real rank through torchrig's Accelerator, each recorded.

    Several (:data:`MEASURED_STEPS`), because gloo's worker thread races the step: it drops its reference
    to a finished collective's input (the last one, e.g. tensor parallel's local logits before their
    all-gather) when it next gets the GIL, which under load is after the main thread has gone on — so a
    step's tracked peak can include a buffer the program had already let go (measured: FSDP2 x TP peak
    282,460 B instead of 273,724 B in about one rank-step in four on the loaded 2-core machine, the peak
    moving from backward to the end of forward). The race only ever adds bytes, so the step with the
    lowest peak is the program's; the collectives and FLOPs of every step are compared."""
    accelerator = Accelerator(cpu=True)
    try:
        _, build = resolve_model(files["model"])
        torch.manual_seed(0)
        model = build()
        optimizer = PLAN_OPTIMIZERS[OPTIMIZER](model.parameters())
        model, optimizer = accelerator.prepare(model, optimizer)
        unwrapped = accelerator.unwrap_model(model)
        inner = getattr(optimizer, "optimizer", optimizer)
        ids = torch.randint(0, hf_models.VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        pp = accelerator.device_submeshes.get("pp")

        def train_step() -> None:
            # a pipelined model runs its schedule in the forward call, the loss computed on the last stage
            loss = model(ids, target=ids) if pp is not None and pp.size() > 1 else model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

        # unrecorded: the optimizer state exists, a pipeline has exchanged its stages' shapes (first step)
        # and DDP has rebuilt its buckets (second forward: a one-time broadcast of rank 0's bucket order)
        for _ in range(WARM_UP_STEPS):
            train_step()
        mesh = accelerator.torch_device_mesh
        axes = mesh_axes(mesh) if mesh is not None else {}
        steps = []
        for _ in range(MEASURED_STEPS):
            with track_step_memory(unwrapped, [inner]) as memory, StepRecorder(axes) as recorder:
                train_step()
            steps.append({"collectives": [s.as_dict() for s in recorder.summary()],
                          "flops": recorder.flops_by_phase(), "memory": memory.result.as_dict()})
        return steps
    finally:
        accelerator.end_training()


def _measured_steps(ctx: WorkerContext, files: dict[str, str], layouts: list[str]) -> dict[str, Any]:
    """On each pool rank: every layout's step, each under its own run file."""
    results = {}
    for layout in layouts:
        with rank_environment(ctx.rank, ctx.world_size, _environment(files, layout)):
            results[layout] = _measured_step(files, layout)
    return results


@pytest.fixture(scope="module")
def measurements(gloo_pool4: Any, run_files: dict[str, str],
                 predictions: dict[str, PlanReport]) -> list[dict[str, Any]]:
    """Per real rank: the recorded step of every layout that has a prediction (one pooled task)."""
    planned = [layout for layout, report in predictions.items() if _why_unplanned(report) is None]
    return gloo_pool4.run(_measured_steps, run_files, planned, timeout=TIMEOUT)


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_plan_predicts_what_a_real_4_rank_step_does(layout: str, predictions: dict[str, PlanReport],
                                                        measurements: list[dict[str, Any]]) -> None:
    report = predictions[layout]
    why = _why_unplanned(report)
    assert why is None, f"{layout} is not planned: {why}"
    expected_ranks = [0, 2] if layout == "pp_dp" else [0]
    assert [plan.rank for plan in report.ranks] == expected_ranks
    for plan in report.ranks:
        steps = measurements[plan.rank][layout]
        predicted = plan.step
        where = f"{layout}, rank {plan.rank}"
        for step in steps:
            assert [s.as_dict() for s in predicted.collectives] == step["collectives"], where
            assert predicted.flops == step["flops"], where
        memory = min((step["memory"] for step in steps), key=lambda m: m["peak_bytes"])
        assert predicted.memory.peak_bytes == pytest.approx(memory["peak_bytes"], rel=0.10), where
        assert predicted.memory.by_category.keys() == memory["by_category"].keys()
        off = {category: (predicted.memory.by_category[category], nbytes)
               for category, nbytes in memory["by_category"].items()
               if predicted.memory.by_category[category] != pytest.approx(nbytes, rel=0.10)}
        if layout in KNOWN_MEMORY_DIFFERENCES:  # still differs (when it is fixed, this fails: drop the entry)
            assert off, f"{where}: the known difference is gone ({KNOWN_MEMORY_DIFFERENCES[layout]})"
            pytest.xfail(f"{where}: {KNOWN_MEMORY_DIFFERENCES[layout]}; (planned, measured) bytes: {off}")
        assert not off, f"{where}: categories beyond 10%, (planned, measured) bytes: {off}"
