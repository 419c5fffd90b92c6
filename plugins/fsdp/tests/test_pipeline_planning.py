"""The pipelined step of a planned run (``torchrig plan``, torchrig_fsdp.pp_planning): every stage's step runs on
torch's fake process group in one process, issuing what torch's schedule issues on that rank — the boundary
activations sent and their gradients received per micro-batch, FSDP2's gradient reduce-scatter once per step —
and holding a 1F1B stage's activations to its in-flight micro-batches.

One process each (fake worlds of 8 ranks), a tiny Llama and the test kit's PipeLM, a few seconds per plan.
"""

from __future__ import annotations

import sys

import pytest
import yaml
from torch.autograd.graph import saved_tensors_hooks
from torchrig.estimate.plan import PlanInputs, PlanTarget, plan_run, recorded_step
from torchrig.testing import hf_models

# plans at target scale on fake process groups (~20 s in all): the default run, not the fast tier
pytestmark = pytest.mark.scale

SEQ = 8
HIDDEN = hf_models.config("llama").hidden_size


def _config(tmp_path, parallelism: dict) -> dict[str, str]:
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"distributed_type": "FSDP", "parallelism_config": parallelism}))
    return {"TORCHRIG_CONFIG_FILE": str(run)}


def _llama(tmp_path, layers: int = 4) -> str:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    hf_models.config("llama", num_hidden_layers=layers).to_json_file(str(model / "config.json"))
    return str(model)


def _pp(recording, kind: str) -> tuple[int, int]:
    """(count, payload bytes) of ``kind`` on the pp axis."""
    found = [c for c in recording.collectives if c.axis == "pp" and c.kind == kind]
    return (found[0].count, found[0].payload_bytes) if found else (0, 0)


def _count(recording, axis: str, kind: str) -> int:
    return sum(c.count for c in recording.collectives if c.axis == axis and c.kind == kind)


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_every_stage_is_planned_sending_each_micro_batchs_activation_and_gradient_to_its_neighbours(tmp_path, schedule):
    # pp 4 x dp_shard 2 on 8 ranks; 4 micro-batches of 2 samples: the first, a middle and the last stage
    report = plan_run(PlanInputs(model=_llama(tmp_path), batch_size=8, seq_len=SEQ,
                                 environment=_config(tmp_path, {"pp_size": 4, "dp_shard_size": 2,
                                                                "pp_schedule": schedule})),
                      PlanTarget(1, 8), recorded_step)
    assert [plan.layout.coordinates["pp"] for plan in report.ranks] == [0, 2, 3]
    boundary = 2 * SEQ * HIDDEN * 4  # one micro-batch's hidden states, fp32
    expected = {0: (4, 4), 2: (8, 8), 3: (4, 4)}  # stage: (sends, receives) — activations forward, gradients back
    for plan in report.ranks:
        assert plan.error is None and plan.unsupported is None, (plan.rank, plan.error, plan.unsupported)
        stage = plan.layout.coordinates["pp"]
        sends, receives = expected[stage]
        assert _pp(plan.step, "send") == (sends, sends * boundary), stage
        assert _pp(plan.step, "recv") == (receives, receives * boundary), stage
        assert _pp(plan.step, "broadcast") == (1, 4)  # the batch's loss, from the last stage
        assert _count(plan.step, "dp_shard", "reduce_scatter") > 0 and _count(plan.step, "dp_shard", "all_gather") > 0


def _saved_tensor_peak(peaks: list[int]):
    """A plan step that also records the most tensors autograd held saved at once (activations kept for backward)."""

    def step(accelerator, model, optimizer, inputs):
        live = [0, 0]

        class Saved:
            def __init__(self, tensor):
                self.tensor = tensor
                live[0] += 1
                live[1] = max(live[1], live[0])

            def __del__(self):
                live[0] -= 1

        with saved_tensors_hooks(Saved, lambda saved: saved.tensor):
            recording = recorded_step(accelerator, model, optimizer, inputs)
        peaks.append(live[1])
        return recording

    return step


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe"])
def test_a_middle_stage_holds_its_in_flight_micro_batches_and_syncs_gradients_once(tmp_path, schedule):
    """Stage 2 of 4 at 4 and 8 micro-batches: 1F1B keeps min(4 - 2, m) = 2 micro-batches' activations either way,
    GPipe all m; the p2p traffic doubles with m, FSDP2's gradient reduce-scatter does not (last micro-batch only)."""
    model = _llama(tmp_path)
    recordings, peaks = [], []
    for microbatches in (4, 8):
        environment = _config(tmp_path, {"pp_size": 4, "dp_shard_size": 2, "pp_schedule": schedule,
                                         "pp_microbatches": microbatches})
        (plan,) = plan_run(PlanInputs(model=model, batch_size=microbatches, seq_len=SEQ, environment=environment,
                                      ranks=(4,)), PlanTarget(1, 8), _saved_tensor_peak(peaks)).ranks
        assert plan.error is None and plan.layout.coordinates["pp"] == 2, plan.error
        recordings.append(plan.step)
    four, eight = recordings
    assert _pp(eight, "send")[0] == 2 * _pp(four, "send")[0] == 16
    assert _count(eight, "dp_shard", "reduce_scatter") == _count(four, "dp_shard", "reduce_scatter") > 0
    if schedule == "1F1B":
        assert peaks[1] == peaks[0]
    else:
        assert peaks[1] > 1.8 * peaks[0]


@pytest.fixture
def pipe_lm(tmp_path, monkeypatch):
    """MODEL ``pp_planning_models:PlannedPipeLM``: the test kit's PipeLM (a user split) with example inputs (token
    ids) on every stage, importable from the working directory as the plan imports a ``module:function``."""
    (tmp_path / "pp_planning_models.py").write_text(
        "import torch\nfrom torchrig.testing.models import PipeLM\n\n\nclass PlannedPipeLM(PipeLM):\n"
        "    def example_inputs(self, batch_size, seq_len):\n"
        "        return torch.zeros(batch_size, seq_len, dtype=torch.long)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "pp_planning_models", raising=False)
    return "pp_planning_models:PlannedPipeLM"


def test_a_user_split_is_planned_interleaved_with_its_probed_boundaries(tmp_path, pipe_lm):
    # 4 stages at layers.1-3 on 2 pp ranks (stages 0, 2 and 1, 3): each rank sends and receives, per micro-batch,
    # one activation and one gradient per stage boundary it touches: stage 0 -> 1, 1 -> 2, 2 -> 3
    from torchrig.testing.models import DIM

    report = plan_run(PlanInputs(model=pipe_lm, batch_size=4, seq_len=SEQ, environment=_config(
        tmp_path, {"pp_size": 2, "dp_shard_size": 4, "pp_schedule": "Interleaved1F1B",
                   "pp_split_points": ["layers.1", "layers.2", "layers.3"]})), PlanTarget(1, 8), recorded_step)
    boundary = 2 * SEQ * DIM * 4
    assert [plan.layout.coordinates["pp"] for plan in report.ranks] == [0, 1]
    for plan in report.ranks:
        assert plan.error is None and plan.unsupported is None, (plan.rank, plan.error)
        # rank 0: stage 0 sends 2 activations, gets 2 gradients; stage 2 gets 2 activations and 2 gradients,
        # sends 2 gradients and 2 activations — 6 each way; rank 1 mirrors it
        assert _pp(plan.step, "send") == (6, 6 * boundary)
        assert _pp(plan.step, "recv") == (6, 6 * boundary)


# ------------------------------------------------------------------------ calibration: a real 4-rank step

CALIBRATED = {"pp_size": 2, "dp_shard_size": 2, "pp_split_points": ["layers.2"], "pp_schedule": "1F1B"}
#: bf16: the boundary's dtype is the stage root's output_dtype (fp32), which the plan must find
PRECISION = "bf16"
PER_RANK = 4  # two micro-batches of 2 samples


def _real_pipelined_step(ctx) -> dict[tuple[str, str], tuple[int, int]]:
    """On each gloo rank (pp 2 x dp_shard 2, PipeLM, bf16): a first step (torch's warm-up and metadata exchange), then
    a steady step recorded — (axis, kind) -> (count, payload bytes)."""
    import torch
    from torchrig import Accelerator, ParallelismConfig
    from torchrig.estimate.costs import summarise_collectives
    from torchrig.estimate.recorder import StepRecorder, mesh_axes
    from torchrig.testing.contracts import rank_environment
    from torchrig.testing.models import PipeLM, lm_data

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="fsdp", mixed_precision=PRECISION,
                                  parallelism_config=ParallelismConfig(**CALIBRATED))
        model = PipeLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        tokens, labels = lm_data(PER_RANK)[:]

        def step():
            accelerator.backward(model(tokens, target=labels))
            optimizer.step()
            optimizer.zero_grad()

        try:
            step()
            with StepRecorder(mesh_axes(accelerator.torch_device_mesh)) as recorder:
                step()
        finally:
            accelerator.end_training()
    return {(s.axis, s.kind): (s.count, s.payload_bytes) for s in summarise_collectives(recorder.collectives)}


@pytest.mark.multiprocess
def test_a_planned_pipeline_rank_issues_what_a_real_4_rank_step_does(tmp_path, pipe_lm, gloo_pool4):
    real = gloo_pool4.run(_real_pipelined_step, timeout=180)
    report = plan_run(PlanInputs(model=pipe_lm, batch_size=PER_RANK, seq_len=8, optimizer="adamw",
                                 environment=_config(tmp_path, CALIBRATED) | {"TORCHRIG_MIXED_PRECISION": PRECISION}),
                      PlanTarget(1, 4), recorded_step)
    assert [plan.rank for plan in report.ranks] == [0, 2]  # the first rank of each stage (mesh pp x dp_shard)
    for plan in report.ranks:
        assert plan.error is None and plan.layout.mixed_precision == PRECISION, plan.error
        planned = {(s.axis, s.kind): (s.count, s.payload_bytes) for s in plan.step.collectives}
        assert planned == real[plan.rank], plan.rank


def test_a_user_split_whose_boundaries_cannot_be_probed_on_the_meta_device_is_a_limit_of_the_plan(tmp_path, pipe_lm):
    # the first stage reads a value of its token ids (fine on a real rank, impossible on the meta device): the
    # second stage's input cannot be found, said as PlanningUnsupported with the layout kept, not as a failure
    (tmp_path / "pp_checked_models.py").write_text(
        "from pp_planning_models import PlannedPipeLM\n\n\nclass CheckedPipeLM(PlannedPipeLM):\n"
        "    def forward(self, tokens):\n"
        "        if self.embed is not None and int(tokens.max()) >= self.embed.num_embeddings:\n"
        "            raise ValueError('token out of range')\n"
        "        return super().forward(tokens)\n")
    sys.modules.pop("pp_checked_models", None)
    report = plan_run(PlanInputs(model="pp_checked_models:CheckedPipeLM", batch_size=4, seq_len=SEQ, ranks=(4,),
                                 environment=_config(tmp_path, {"pp_size": 2, "dp_shard_size": 4,
                                                                "pp_split_points": ["layers.2"]})),
                      PlanTarget(1, 8), recorded_step)
    (plan,) = report.ranks
    assert plan.error is None and plan.layout.coordinates["pp"] == 1
    assert plan.unsupported.startswith("pipeline stage 0: the tensors it passes on cannot be found on the meta device")
    assert "meta" in plan.unsupported.split(": ", 2)[-1]  # torch's own reason follows


def test_a_pipeline_x_tensor_parallel_stage_in_bf16_receives_what_its_fsdp_root_returns(tmp_path):
    # pp 2 x tp 2 x dp_shard 2, bf16: the stage root's policy returns fp32 (output_dtype), so the hidden states
    # cross stages in fp32; the layers' tensor-parallel all-reduces run inside the stage
    report = plan_run(PlanInputs(model=_llama(tmp_path, layers=2), batch_size=4, seq_len=SEQ, ranks=(4,),
                                 environment=_config(tmp_path, {"pp_size": 2, "tp_size": 2, "dp_shard_size": 2})
                                 | {"TORCHRIG_MIXED_PRECISION": "bf16"}), PlanTarget(1, 8), recorded_step)
    (plan,) = report.ranks
    assert plan.error is None and plan.unsupported is None, plan.error
    assert plan.layout.coordinates == {"pp": 1, "dp_shard": 0, "tp": 0} and plan.layout.mixed_precision == "bf16"
    boundary = 2 * SEQ * HIDDEN * 4
    assert _pp(plan.step, "recv") == (2, 2 * boundary) and _pp(plan.step, "send") == (2, 2 * boundary)
    assert _count(plan.step, "tp", "all_reduce") > 0
