"""The fp8 precision plugin in one process, emulated on the CPU: which layers are converted (and
the report saying so), that the converted layers really compute on torchao's fp8 tensors and the
rest in bf16, that a tiny transformer trains within a tolerance of bf16, compile after conversion,
and every refusal (no emulation on a CPU, other backends' keys, impossible combinations)."""

from __future__ import annotations

import types

import pytest
import torch
from fp8_models import ProbedLM, batches, lm_loss
from torchao.float8.float8_linear import Float8Linear
from torchrig import Accelerator
from torchrig.cli.main import main
from torchrig.config.options import TorchDynamoPlugin
from torchrig.errors import ConfigError
from torchrig.plugin.types import Capabilities
from torchrig.testing.effects import assert_compiled, assert_modules_converted, count_compilation, record_forward_dtypes
from torchrig_fp8.convert import conversion_report, convert_model_to_fp8_ao, has_ao_layers
from torchrig_fp8.options import AORecipeKwargs, FP8RecipeKwargs
from torchrig_fp8.precision import Float8Precision

CONVERTIBLE = 9  # 2 blocks x (qkv, proj, up, down) + head; the 32x10 probe is not


def prepared(*handlers, **kwargs):
    accelerator = Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=list(handlers), **kwargs)
    torch.manual_seed(0)
    model = ProbedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def train(accelerator, model, optimizer, steps: int = 30) -> list[float]:
    losses = []
    for tokens in batches(steps):
        loss = lm_loss(model, tokens)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(("options", "converted", "skipped"), [
    ({}, CONVERTIBLE, {"probe": "32x10 features, not multiples of 16"}),
    ({"skip_first_last": True}, CONVERTIBLE - 1, {"blocks.0.qkv": "first Linear layer", "probe": "last Linear layer"}),
    ({"exclude_modules": ["blocks.*.up", "head"]}, CONVERTIBLE - 3,
     {"blocks.0.up": "matches exclude_modules 'blocks.*.up'", "blocks.1.up": "matches exclude_modules 'blocks.*.up'",
      "head": "matches exclude_modules 'head'", "probe": "32x10 features, not multiples of 16"}),
    ({"pad_inner_dim": True}, CONVERTIBLE + 1, {}),
    ({"module_filter_func": lambda module, name: name.endswith("down")}, 2, None),
])
def test_the_filter_converts_what_it_reports(options, converted, skipped, caplog):
    caplog.set_level("INFO", logger="torchrig_fp8.precision")
    accelerator, model, _ = prepared(AORecipeKwargs(emulate=True, **options))
    module = accelerator.unwrap_model(model)
    names = assert_modules_converted(module, Float8Linear, count=converted)
    report = conversion_report(module)
    assert report is not None and list(report.converted) == names and report.total == CONVERTIBLE + 1
    if skipped is not None:
        assert report.skipped == skipped
    assert f"fp8: converted {converted} of {CONVERTIBLE + 1} Linear layers of ProbedLM" in caplog.text
    assert accelerator.mixed_precision == "fp8"


def test_converted_layers_compute_on_fp8_tensors_and_the_rest_in_bf16():
    accelerator, model, _ = prepared(AORecipeKwargs(emulate=True))
    with record_forward_dtypes(accelerator.unwrap_model(model)) as record:
        lm_loss(model, batches(1)[0])
    by_module = {call.module: call for call in record.calls}
    for name in ("blocks.0.qkv", "blocks.1.down", "head"):
        assert set(by_module[name].tensor_types) == {"Float8TrainingTensor"}, by_module[name]
    assert by_module["probe"].tensor_types == () and set(by_module["probe"].dtypes) == {torch.bfloat16}
    assert set(by_module["blocks.0"].dtypes) == {torch.bfloat16}  # attention: autocast bf16
    assert accelerator.step_plan.owners["autocast"] == "precision:fp8"


def test_a_tiny_transformer_trains_within_a_tolerance_of_bf16():
    fp8 = train(*prepared(AORecipeKwargs(emulate=True)))
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    torch.manual_seed(0)
    model = ProbedLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    bf16 = train(accelerator, *accelerator.prepare(model, optimizer))
    assert fp8[-1] < 0.5 * fp8[0], fp8
    # fp8 quantization error (~0.05 relative) on top of bf16's: the curves stay close
    assert abs(fp8[-1] - bf16[-1]) < 0.15 * bf16[0], (fp8[-1], bf16[-1])


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise_with_gw_hp"])
def test_rowwise_recipes_train(recipe):
    accelerator, model, optimizer = prepared(FP8RecipeKwargs(backend="ao", recipe=recipe, emulate=True))
    assert conversion_report(accelerator.unwrap_model(model)).recipe == recipe
    losses = train(accelerator, model, optimizer, steps=15)
    assert losses[-1] < 0.7 * losses[0], losses


def test_optimizer_built_before_prepare_steps_the_converted_weights():
    accelerator, model, optimizer = prepared(AORecipeKwargs(emulate=True))
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert {id(p) for p in accelerator.unwrap_model(model).parameters()} == held
    before = accelerator.unwrap_model(model).blocks[0].qkv.weight.detach().clone()
    train(accelerator, model, optimizer, steps=1)
    assert not torch.equal(before, accelerator.unwrap_model(model).blocks[0].qkv.weight)


def test_compile_after_conversion_runs_compiled_code():
    """aot_eager: dynamo and AOTAutograd trace torchao's fp8 tensor subclasses (inductor also works
    here, in 40-110 s: test_inductor_compiles_the_fp8_model, marked slow)."""
    accelerator, model, optimizer = prepared(AORecipeKwargs(emulate=True),
                                             dynamo_plugin=TorchDynamoPlugin(backend="aot_eager"))
    with count_compilation() as counts:
        losses = train(accelerator, model, optimizer, steps=3)
    assert_compiled(counts, min_frames=1)
    assert accelerator.compile_report()["modules"]["ProbedLM"]["compiled"]
    assert_modules_converted(accelerator.unwrap_model(model), Float8Linear, count=CONVERTIBLE)
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_inductor_compiles_the_fp8_model():
    accelerator, model, optimizer = prepared(AORecipeKwargs(emulate=True),
                                             dynamo_plugin=TorchDynamoPlugin(backend="inductor"))
    with count_compilation() as counts:
        losses = train(accelerator, model, optimizer, steps=3)
    assert_compiled(counts, min_frames=1)
    assert losses[-1] < losses[0]


def test_the_emulation_switch_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("TORCHRIG_FP8_CONFIG__EMULATE", "1")
    accelerator, model, _ = prepared()
    assert conversion_report(accelerator.unwrap_model(model)).emulate


def test_accelerate_names_resolve_to_the_plugin():
    from torchrig.utils import AORecipeKwargs as from_utils
    from torchrig.utils import FP8RecipeKwargs as deprecated
    from torchrig.utils import convert_model_to_fp8_ao as convert

    assert from_utils is AORecipeKwargs and deprecated is AORecipeKwargs and convert is convert_model_to_fp8_ao
    model = ProbedLM()
    report = convert(model)  # Accelerate's default: first and last Linear layers stay high precision
    assert has_ao_layers(model) and sorted(report.skipped) == ["blocks.0.qkv", "probe"]


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("handler", "key", "message"), [
    (AORecipeKwargs(), "mixed_precision", "this run's device is cpu"),
    (FP8RecipeKwargs(backend="TE", emulate=True), "fp8_config.backend", "torchrig's fp8 runs on torchao"),
    (AORecipeKwargs(margin=0, emulate=True), "fp8_config.margin", "TransformerEngine option"),
    (AORecipeKwargs(opt_level="O2", emulate=True), "fp8_config.opt_level", "MS-AMP option"),
    (AORecipeKwargs(recipe="rowwise", enable_fsdp_float8_all_gather=True, emulate=True),
     "fp8_config.enable_fsdp_float8_all_gather", "needs the tensorwise recipe"),
])
def test_what_cannot_take_effect_is_refused_naming_the_key(handler, key, message):
    with pytest.raises(ConfigError) as caught:
        Accelerator(cpu=True, mixed_precision="fp8", kwargs_handlers=[handler])
    assert key in str(caught.value) and message in str(caught.value)


def test_no_emulation_on_a_cpu_is_refused_with_the_switch_named():
    with pytest.raises(ConfigError, match="fp8_config.emulate: true"):
        Accelerator(cpu=True, mixed_precision="fp8")


def test_launch_without_emulation_on_cpu_exits_2_with_the_reason(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCHRIG_CONFIG_HOME", str(tmp_path))
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a worker started')\n")
    code = main(["launch", "--cpu", "--num_processes", "2", "--mixed_precision", "fp8", str(script)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "mixed_precision" in err and "--fp8_emulate" in err and "Traceback" not in err


def test_an_accelerate_file_with_transformer_engine_keys_is_refused_by_key(tmp_path):
    config = tmp_path / "accelerate.yaml"
    config.write_text("mixed_precision: fp8\nuse_cpu: true\nfp8_config:\n  backend: TE\n  fp8_format: HYBRID\n"
                      "  amax_history_length: 1024\n")
    with pytest.raises(ConfigError) as caught:
        Accelerator(config_file=str(config))
    text = str(caught.value)
    for key in ("fp8_config.backend", "fp8_config.fp8_format", "fp8_config.amax_history_len"):
        assert key in text, text


def test_a_strategy_that_owns_precision_without_fully_shard_is_refused():
    """DeepSpeed's engine keeps its own weights and casts: fp8 does not compose with it."""
    run = types.SimpleNamespace(capabilities=Capabilities(owns_precision=True, fully_shard_parameters=False))
    with pytest.raises(RuntimeError, match="use the fsdp or ddp strategy for fp8"):
        Float8Precision().torchrig_convert_model(run=run, model=ProbedLM())


def test_deepspeed_with_fp8_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match="cannot run under DeepSpeed") as caught:
        Accelerator(cpu=True, strategy="deepspeed", mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(emulate=True)])
    assert "mixed_precision" in str(caught.value) and "fsdp or ddp" in str(caught.value)


@pytest.mark.parametrize("source", ["argument", "file", "environment"])
def test_fp8_is_selected_from_every_config_source(source, tmp_path, monkeypatch):
    kwargs = {"cpu": True}
    if source == "argument":
        kwargs.update(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(emulate=True, skip_first_last=True)])
    elif source == "file":
        config = tmp_path / "run.yaml"
        config.write_text("mixed_precision: fp8\nfp8_config:\n  emulate: true\n  skip_first_last: true\n")
        kwargs["config_file"] = str(config)
    else:
        monkeypatch.setenv("TORCHRIG_MIXED_PRECISION", "fp8")
        monkeypatch.setenv("TORCHRIG_FP8_CONFIG__EMULATE", "true")
        monkeypatch.setenv("TORCHRIG_FP8_CONFIG__SKIP_FIRST_LAST", "1")
    accelerator = Accelerator(**kwargs)
    model = accelerator.prepare(ProbedLM())
    report = conversion_report(accelerator.unwrap_model(model))
    assert accelerator.mixed_precision == "fp8" and report.emulate and len(report.converted) == CONVERTIBLE - 1


def test_fp8_all_gather_asked_where_nothing_is_sharded_is_reported_once(caplog):
    accelerator, model, _ = prepared(AORecipeKwargs(emulate=True, enable_fsdp_float8_all_gather=True))
    notes = [r for r in caplog.records if "enable_fsdp_float8_all_gather has no effect" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelname == "WARNING"
    assert not conversion_report(accelerator.unwrap_model(model)).fsdp_float8_all_gather
