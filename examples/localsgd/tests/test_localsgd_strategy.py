"""torchrig-localsgd's own tests, as a third-party plugin author writes them: the strategy contract
from torchrig's test kit, plus what is particular to local SGD. Run from examples/localsgd with
`python -m pytest` (or from the repository root, where CI runs them).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from torchrig.testing.contracts import StrategyContract, rank_environment

pytestmark = pytest.mark.multiprocess

HERE = pathlib.Path(__file__).resolve().parents[1]


def _sync_every(k: int) -> dict:
    from torchrig_localsgd.options import LocalSGDKwargs

    return {"kwargs_handlers": [LocalSGDKwargs(sync_every=k)]}


class TestLocalSGDStrategy(StrategyContract):
    """Averaging every step: for plain SGD the same trajectory as averaging gradients (so the
    inherited "equals one process on the concatenated batch" holds). Gradients themselves are
    never all-reduced, so each rank's clip norm is its own."""

    strategy = "localsgd"
    world_size = 2
    options = _sync_every(1)
    synchronizes_gradients = False
    invalid_configs = [({"localsgd_config": {"sync_every": 0}}, "localsgd_config.sync_every")]


class TestLocalSGDStrategyEveryThirdStep(TestLocalSGDStrategy):
    """Averaging every third step: the contract's checkpoints and validation hold as they are; the
    tests that assume synchronous steps are replaced by the local-SGD ones below."""

    options = _sync_every(3)

    def test_prepare_and_one_step_update_parameters_identically_on_all_ranks(self, on_ranks):
        pytest.skip("ranks differ between averages by design; see test_ranks_drift_apart_and_meet_every_k_steps")

    def test_training_equals_one_process_on_the_concatenated_batch(self, on_ranks):
        pytest.skip("local SGD with K > 1 is not synchronous SGD; see test_the_average_is_the_mean_of_the_local_models")

    def test_accumulation_steps_only_at_the_boundary_and_ranks_agree(self, on_ranks):
        pytest.skip("the first boundary is a local step when K > 1; see test_ranks_drift_apart_and_meet_every_k_steps")


def _train(ctx, sync_every: int, steps: int) -> dict:
    """Plain SGD, rank-specific data; parameters after each step, and averaged by save_model's path."""
    import torch
    from torchrig import Accelerator
    from torchrig.testing.contracts._common import flat_params, tiny_batch, tiny_model

    with rank_environment(ctx.rank, ctx.world_size):
        accelerator = Accelerator(cpu=True, strategy="localsgd", **_sync_every(sync_every))
        model = tiny_model()
        model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        trace = []
        for step in range(steps):
            x, y = tiny_batch(accelerator.process_index, seed=step)
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            trace.append(flat_params(model))
        averaged = accelerator.get_state_dict(model)
        return {"trace": trace, "averaged": torch.cat([v.reshape(-1) for v in averaged.values()]).tolist(),
                "owner": accelerator.step_plan.owners["optimizer_step"]}


def test_ranks_drift_apart_and_meet_every_k_steps(gloo_pool):
    rank0, rank1 = gloo_pool.run(_train, 3, 6, timeout=120)
    same = [a == b for a, b in zip(rank0["trace"], rank1["trace"])]
    assert same == [False, False, True, False, False, True]
    assert rank0["owner"] == "strategy:localsgd"


def test_the_average_is_the_mean_of_the_local_models(gloo_pool):
    rank0, rank1 = gloo_pool.run(_train, 4, 2, timeout=120)  # no average yet: the models differ
    mean = [(a + b) / 2 for a, b in zip(rank0["trace"][-1], rank1["trace"][-1])]
    assert rank0["averaged"] == rank1["averaged"]
    assert max(abs(a - m) for a, m in zip(rank0["averaged"], mean)) < 1e-6


def test_manifest_contributes_the_section_and_the_flag_without_torch():
    code = ("import sys\nfrom torchrig.cli.main import main\n"
            "code = main(['config', 'show', '--localsgd_sync_every', '7'])\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO_TORCH', code)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "localsgd_config.sync_every" in result.stdout and "--localsgd_sync_every" in result.stdout
    assert result.stdout.strip().endswith("NO_TORCH 0")


@pytest.mark.timeout(240)
def test_example_script_runs_under_torchrig_launch(tmp_path, process_guard):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchrig", "launch", "--num_processes", "2", "--strategy", "localsgd",
         "--localsgd_sync_every", "4", "--log_dir", str(tmp_path / "logs"), str(HERE / "train_localsgd.py"),
         "--steps", "40"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, start_new_session=True)
    process_guard.track(proc)
    out, err = proc.communicate(timeout=200)
    assert proc.returncode == 0, err
    assert "strategy localsgd, 2 processes, parameters averaged every 4 steps" in out
    final = [line for line in out.splitlines() if "final loss" in line]
    assert final and "ranks agree: True" in final[0], out
    first, last = (float(v) for v in final[0].split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first, final[0]
