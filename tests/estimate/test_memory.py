"""``torchrig estimate-memory``: the command's conventions, and its estimates against memory
measured on the CPU — the analytic model (DeepSpeed's, and the core's default for a strategy the plan
cannot run): one process (parameters, gradients, optimizer state, activations) and two gloo ranks under
DeepSpeed ZeRO (per-rank shards); every strategy the plan can run is sized by a planned step.

Tolerance (docs/estimate-memory.md): the state a step holds (parameters, gradients, optimizer
state, master weights) within ``STATE_TOLERANCE`` of the measured bytes; activations within
``ACTIVATION_TOLERANCE`` of the bytes a real forward saves for backward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torchrig.cli.estimate import estimate_memory
from torchrig.cli.main import main
from torchrig.estimate.memory import MemoryRequest
from torchrig.estimate.memory_model import SavedTensorCounter, build_on_meta, footprint, training_loss
from torchrig.host.plugin_host import PluginHost
from torchrig.testing import resolved_config
from torchrig.testing.contracts import rank_environment
from torchrig.testing.memory import bytes_held_since, live_storages

TIMEOUT = 180
STATE_TOLERANCE = 0.05
ACTIVATION_TOLERANCE = 0.05
#: DeepSpeed ZeRO 1-3: its flat partitions are aligned and padded unevenly across ranks, and ZeRO-1
#: already holds partitioned gradients after backward (docs/estimate-memory.md).
ZERO_TOLERANCE = 0.15
#: Components held only for part of a step (not in the after-backward measurement).
TRANSIENT = ("activations", "all-gathered parameters", "unsharded gradients", "gradient buckets")
HERE = os.path.dirname(os.path.abspath(__file__))
GPT2_CONFIG = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_embd": 64, "n_head": 4,
               "vocab_size": 128, "n_positions": 64, "bos_token_id": 0, "eos_token_id": 0}


def mlp() -> torch.nn.Module:
    """The pinned benchmark model (DESIGN.md §8)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


class EncoderStack(torch.nn.Module):
    """Embedding, torch's own ``TransformerEncoderLayer`` s, a head: the layers a memory estimate meets in practice."""

    def __init__(self, vocab: int = 128, width: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, 4, 64, dropout=0.0, batch_first=True) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for block in self.blocks:
            hidden = block(hidden)
        return self.head(hidden)


def tiny_transformer() -> torch.nn.Module:
    torch.manual_seed(0)
    return EncoderStack()


FACTORIES = {"mlp": mlp, "transformer": tiny_transformer}


def inputs(name: str, batch: int = 4, seq: int = 16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    if name == "mlp":
        return torch.randn(batch, 32, generator=generator)
    return torch.randint(0, 128, (batch, seq), generator=generator)


def estimate(name: str, strategy: str, world: int, config: dict | None = None, batch: int = 4, seq: int = 16,
             precision: str = "no"):
    model = build_on_meta(FACTORIES[name], name)
    request = MemoryRequest(model=footprint(model, name, batch_size=batch, seq_len=seq), world_size=world,
                            strategy=strategy, config=resolved_config(config), precision=precision)
    return estimate_memory(PluginHost(), request)


def held_state(estimate) -> int:
    return sum(c.bytes for c in estimate.components if c.name not in TRANSIENT and c.location == "device")


def run_steps(model, optimizer, x, backward) -> None:
    """One full step (allocates the optimizer state), then a forward and backward: measured after
    it, a step holds parameters, gradients, optimizer state and master weights; activations are freed."""
    for last in (False, True):
        backward(training_loss(model(x)))
        if not last:
            optimizer.step()


# -- one process -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_single_process_estimate_matches_measured_state_and_activations(name):
    baseline = live_storages()
    model = FACTORIES[name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = inputs(name)
    run_steps(model, optimizer, x, lambda loss: loss.backward())
    measured_state = bytes_held_since(baseline) - x.untyped_storage().nbytes()
    counter = SavedTensorCounter(model.parameters())
    with counter:
        loss = training_loss(model(x))
    measured_activations = counter.bytes
    del loss
    predicted = estimate(name, "single", 1)
    print(f"{name}: state measured {measured_state} estimated {held_state(predicted)}; activations measured "
          f"{measured_activations} estimated {predicted.component('activations')}")
    assert held_state(predicted) == pytest.approx(measured_state, rel=STATE_TOLERANCE)
    assert predicted.component("activations") == pytest.approx(measured_activations, rel=ACTIVATION_TOLERANCE)


def test_deepspeed_options_change_its_estimate():
    """DeepSpeed, which the plan cannot run, answers from its manifest (ddp and fsdp are sized by a
    planned step: test_factory_json_sums_components_and_compares_strategies, tests/estimate/test_plan_calibration.py)."""
    parameters = sum(p.numel() for p in mlp().parameters())
    offload = estimate("mlp", "deepspeed", 2, {"deepspeed_config.zero_stage": 2,
                                              "deepspeed_config.offload_optimizer_device": "cpu"})
    assert offload.total("cpu") == offload.component("optimizer state") + offload.component("master weights (fp32)") > 0
    bucket = estimate("mlp", "deepspeed", 2, {"deepspeed_config.zero_stage": 3,
                                             "deepspeed_config.hf_ds_config": {"zero_optimization": {
                                                 "reduce_bucket_size": 1000, "stage3_param_persistence_threshold": 0}}})
    assert bucket.component("reduce bucket") == 4000
    assert bucket.component("parameters") == 4 * -(-parameters // 2)
    bf16 = estimate("mlp", "deepspeed", 1, {"deepspeed_config.zero_stage": 0}, precision="bf16")
    assert bf16.component("parameters") == 2 * parameters and bf16.component("master weights (fp32)") == 4 * parameters


# -- two gloo ranks ------------------------------------------------------------------------------


def _measure(ctx, name, strategy, options):
    import gc

    from torchrig import Accelerator

    with rank_environment(ctx.rank, ctx.world_size):
        gc.collect()
        baseline = live_storages()
        accelerator = Accelerator(cpu=True, strategy=strategy, **options())
        model = FACTORIES[name]()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        x = inputs(name)
        run_steps(model, optimizer, x, accelerator.backward)
        held = bytes_held_since(baseline) - x.untyped_storage().nbytes()
        del model, optimizer, accelerator
        gc.collect()
        return held


def _zero(stage):
    def options():
        from torchrig_deepspeed.options import DeepSpeedPlugin

        return {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=stage)}
    return options


def _measure_zero_stages(ctx, name, stages):
    return [_measure(ctx, name, "deepspeed", _zero(stage)) for stage in stages]


def test_deepspeed_zero_stages_per_rank_state_matches_the_estimate(gloo_pool):
    name, stages = "transformer", (1, 2, 3)
    measured = gloo_pool.run(_measure_zero_stages, name, stages, timeout=TIMEOUT)
    for index, stage in enumerate(stages):
        predicted = held_state(estimate(name, "deepspeed", 2, {"deepspeed_config.zero_stage": stage}))
        print(f"deepspeed ZeRO-{stage} {name}: measured {[m[index] for m in measured]} estimated {predicted}")
    for index, stage in enumerate(stages):
        predicted = held_state(estimate(name, "deepspeed", 2, {"deepspeed_config.zero_stage": stage}))
        tolerance = STATE_TOLERANCE if stage == 0 else ZERO_TOLERANCE
        for per_rank in measured:
            assert predicted == pytest.approx(per_rank[index], rel=tolerance), f"ZeRO-{stage}"


# -- the command -------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def no_machine_config(tmp_path, monkeypatch):
    """The machine's default config file and TORCHRIG_* variables stay out of these runs."""
    for name in [n for n in os.environ if n.startswith("TORCHRIG_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path / "config-home"))


def _cli(capsys, *argv):
    code = main(["estimate-memory", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_factory_json_sums_components_and_compares_strategies(capsys, monkeypatch):
    """DDP and FSDP2 are sized by one planned step (the plan's engine, the project's one memory model),
    DeepSpeed — which the plan cannot run — by its manifest's estimate on the meta-device model."""
    monkeypatch.chdir(HERE)
    code, out, err = _cli(capsys, "test_memory:tiny_transformer", "--batch_size", "4", "--seq_len", "16",
                          "--num_processes", "2", "--compare", "fsdp,deepspeed", "--zero_stage", "2", "--json")
    assert code == 0, err
    report = json.loads(out)
    labels = [e["label"] for e in report["estimates"]]
    assert labels == ["ddp", "fsdp (dp_shard 2)", "deepspeed ZeRO-2"]
    for item in report["estimates"]:
        device = sum(c["bytes"] for c in item["components"] if c["location"] == "device")
        assert item["total_device_bytes"] == device > max(c["bytes"] for c in item["components"])
    ddp, fsdp, deepspeed = report["estimates"]
    recorded = "recorded from one planned training step of rank 0"
    assert recorded in ddp["notes"][0] and recorded in fsdp["notes"][0]
    assert not any(recorded in note for note in deepspeed["notes"])
    parameter_bytes = 4 * sum(p.numel() for p in tiny_transformer().parameters())
    lines = {item["label"]: {c["name"]: c["bytes"] for c in item["components"]} for item in report["estimates"]}
    assert lines["ddp"]["parameters"] == parameter_bytes  # replicated; FSDP2 holds its dim-0 shards
    assert lines["fsdp (dp_shard 2)"]["parameters"] < parameter_bytes // 2 + 1024
    assert lines["ddp"]["temporaries"] > 0  # the reducer's gradient buckets
    assert fsdp["total_device_bytes"] < ddp["total_device_bytes"]
    assert report["model"]["activation_bytes"] == 176640  # DeepSpeed's estimate needs them: the single-process test's


def test_a_run_that_would_fail_exits_1_naming_the_rank(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CONFIG))
    code, _, err = _cli(capsys, str(tmp_path), "--seq_len", "8", "--num_processes", "8", "--use_fsdp",
                        "--tp_size", "8", "--dp_shard_size", "1")
    assert code == 1, err
    assert "the run would fail: fsdp, rank 0: accelerator.prepare(model, optimizer)" in err, err


def test_transformers_config_file_estimates_activations(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(GPT2_CONFIG))
    code, out, err = _cli(capsys, str(tmp_path), "--batch_size", "2", "--seq_len", "8")
    assert code == 0, err
    assert "GPT2Block" in out and "activations" in out and "total (device)" in out


@pytest.mark.parametrize(("argv", "named"), [
    (["no_such_module_xyz:build"], "no_such_module_xyz"),
    (["test_memory:nothing_here"], "nothing_here"),
    (["surely-not-cached/model-xyz"], "local cache"),
    (["test_memory.py"], "not a readable JSON config"),
    (["test_memory:mlp", "--batch_size", "0"], "--batch_size"),
    (["test_memory:mlp", "--optimizer", "lion"], "--optimizer"),
])
def test_bad_input_exits_2_naming_what_is_wrong(capsys, monkeypatch, argv, named):
    monkeypatch.chdir(HERE)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = _cli(capsys, *argv)
    assert code == 2
    assert named in err and "Traceback" not in err


def test_a_directory_without_config_json_is_named(tmp_path, capsys):
    code, _, err = _cli(capsys, str(tmp_path))
    assert code == 2 and f"MODEL {str(tmp_path)!r} is a directory without a config.json" in err


@pytest.mark.multiprocess
def test_help_imports_no_torch():
    code = ("import sys\nfrom torchrig.cli.main import main\ntry:\n    main(['estimate-memory', '--help'])\n"
            "except SystemExit:\n    pass\nassert 'torch' not in sys.modules, 'estimate-memory --help imported torch'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert "--batch_size" in result.stdout and "--compare" in result.stdout and "--zero_stage" in result.stdout
