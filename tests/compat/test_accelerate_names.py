"""The Accelerate name table (``torchrig.compat.accelerate_names``): it holds exactly the public names
of Accelerate's modules (the snapshot ``tests/compat/data/accelerate_names.json``, generated from
Accelerate's own source by ``tests/compat/data/gen_accelerate_names.py``), every implemented name imports
from the same module path under ``torchrig``, every refusal says why and what to use, and the state
objects report Accelerate's ``DistributedType``/``PrecisionType`` from what the plugins declare."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torchrig
from torchrig.compat.accelerate_names import ACCELERATE_SOURCE, MIRRORED_UTILS_SUBMODULES, TABLE
from torchrig.compat.resolve import plugin_export, torchrig_path
from torchrig.compat.targets import FromPlugin, Refused, RefusedNameError
from torchrig.host.discovery import load_reference
from torchrig.testing.contracts import rank_environment

SNAPSHOT = json.loads((Path(__file__).parent / "data" / "accelerate_names.json").read_text())
TIMEOUT = 180  # seconds a subprocess may take before the test gives up (not a measurement)


def entries(kind: type) -> list[tuple[str, str, object]]:
    return [(module, name, target) for module, names in TABLE.items() for name, target in names.items()
            if isinstance(target, kind)]


def test_the_table_holds_exactly_the_names_accelerate_exposes():
    assert SNAPSHOT["source"] == ACCELERATE_SOURCE
    for module, names in SNAPSHOT["names"].items():
        assert sorted(TABLE[module]) == sorted(names), module
    # mirrored utils submodules hold the names accelerate.utils re-exports from them, with the same targets
    for submodule in MIRRORED_UTILS_SUBMODULES:
        part = TABLE[f"accelerate.utils.{submodule}"]
        assert part and all(TABLE["accelerate.utils"][name] == target for name, target in part.items()), submodule
    assert set(TABLE) == set(SNAPSHOT["names"]) | {f"accelerate.utils.{name}" for name in MIRRORED_UTILS_SUBMODULES}
    assert sum(len(names) for names in SNAPSHOT["names"].values()) > 340


def test_every_module_path_exists_under_torchrig():
    for module in TABLE:
        assert importlib.import_module(torchrig_path(module)).__name__ == torchrig_path(module)


def test_every_implemented_name_imports_from_accelerates_module_path():
    for module, name, target in entries(str):
        expected = load_reference(target)
        got = getattr(importlib.import_module(torchrig_path(module)), name)
        assert got is expected, f"{torchrig_path(module)}.{name}"
        exec(f"from {torchrig_path(module)} import {name} as imported", namespace := {})
        assert namespace["imported"] is expected


def test_every_refusal_raises_an_import_error_saying_why_and_what_to_use():
    refused = entries(Refused)
    assert len(refused) > 100
    for module, name, target in refused:
        with pytest.raises(RefusedNameError) as caught:
            exec(f"from {torchrig_path(module)} import {name}", {})
        message = str(caught.value)
        assert f"{torchrig_path(module)}.{name}" in message and target.reason in message
        assert f"Instead: {target.instead}" in message and "docs/accelerate.md" in message
        assert isinstance(caught.value, ImportError)
        with pytest.raises(ImportError):
            getattr(importlib.import_module(torchrig_path(module)), name)
        assert target.reason.strip() and target.instead.strip()


@pytest.mark.parametrize(("path", "providing_module"), [
    ("torchrig.utils.DeepSpeedPlugin", "torchrig_deepspeed"),
    ("torchrig.utils.FullyShardedDataParallelPlugin", "torchrig_fsdp"),
    ("torchrig.utils.DistributedDataParallelKwargs", "torchrig_ddp"),
    ("torchrig.utils.DDPCommunicationHookType", "torchrig_ddp"),
    ("torchrig.utils.merge_fsdp_weights", "torchrig_fsdp"),
    ("torchrig.tracking.TensorBoardTracker", "torchrig_trackers"),
    ("torchrig.tracking.WandBTracker", "torchrig_trackers"),
    ("torchrig.DeepSpeedPlugin", "torchrig_deepspeed"),
    ("torchrig.utils.DummyOptim", "torchrig_deepspeed"),
    ("torchrig.utils.DummyScheduler", "torchrig_deepspeed"),
    ("torchrig.utils.AORecipeKwargs", "torchrig_fp8"),
    ("torchrig.utils.FP8RecipeKwargs", "torchrig_fp8"),
    ("torchrig.utils.convert_model_to_fp8_ao", "torchrig_fp8"),
])
def test_plugin_provided_names_come_from_the_installed_first_party_plugin(path, providing_module):
    module, name = path.rsplit(".", 1)
    value = getattr(importlib.import_module(module), name)
    assert value.__module__.split(".")[0] == providing_module


def test_plugin_provided_names_no_installed_plugin_exports_are_refused_naming_what_provides_them():
    missing = [(module, name, target) for module, name, target in entries(FromPlugin)
               if plugin_export(target.export) is None and target.fallback is None]
    assert any(name == "CometMLTracker" for _, name, _ in missing)
    for module, name, target in missing:
        with pytest.raises(RefusedNameError, match="provided by a plugin") as caught:
            getattr(importlib.import_module(torchrig_path(module)), name)
        assert target.provided_by in str(caught.value)


@pytest.mark.multiprocess
def test_an_installed_plugin_that_cannot_load_its_export_is_named_with_the_cause():
    """torchrig-deepspeed installed, DeepSpeed itself not importable: the refusal names the plugin, the import
    failure and the install command, not "no installed plugin provides it"."""
    code = ("import sys; sys.modules['deepspeed'] = None\n"
            "try:\n    from torchrig.utils import GatheredParameters\n"
            "except ImportError as exc:\n    print(type(exc).__name__, exc)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=TIMEOUT)
    assert run.stdout.startswith("RefusedNameError GatheredParameters comes from the strategy plugin 'deepspeed' "
                                 "(torchrig-deepspeed), which is installed but cannot load it"), run.stdout
    assert "pip install 'torchrig[deepspeed]'" in run.stdout


def test_a_name_accelerate_does_not_have_is_a_plain_attribute_error():
    assert not hasattr(torchrig, "no_such_name")
    assert not hasattr(torchrig.utils, "no_such_name")
    with pytest.raises(AttributeError, match="no_such_name") as caught:
        torchrig.state.no_such_name
    assert not isinstance(caught.value, ImportError)
    assert "DistributedType" in dir(torchrig) and "gather_object" in dir(torchrig.utils)


@pytest.mark.multiprocess
def test_the_table_and_the_cli_stay_torch_free():
    code = ("import sys; import torchrig, torchrig.utils, torchrig.compat.accelerate_names, torchrig.compat.targets; "
            "torchrig.__dir__(); assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=TIMEOUT)
    help_run = subprocess.run([sys.executable, "-X", "importtime", "-m", "torchrig", "--help"], check=False,
                              capture_output=True, text=True, timeout=TIMEOUT)
    assert help_run.returncode == 0 and "launch" in help_run.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in help_run.stderr.splitlines() if "|" in line}
    assert "torch" not in imported


def test_file_name_constants_are_the_files_save_state_writes(tmp_path):
    from torchrig.utils import OPTIMIZER_NAME, RNG_STATE_NAME, SAFE_MODEL_NAME, SAFE_WEIGHTS_NAME, SCHEDULER_NAME

    accelerator = torchrig.Accelerator(cpu=True)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.save_state(str(tmp_path / "checkpoint"))
    written = {path.name for path in (tmp_path / "checkpoint").iterdir()}
    assert {SAFE_WEIGHTS_NAME, f"{SAFE_MODEL_NAME}.safetensors", f"{SCHEDULER_NAME}.bin", f"{RNG_STATE_NAME}_0.pkl"
            } <= written, written
    assert any(name.startswith(f"{OPTIMIZER_NAME}.") for name in written)  # safetensors here, .bin in Accelerate
    accelerator.end_training()


# -- DistributedType / PrecisionType from the manifests ------------------------------------------


def test_a_single_process_run_is_no_with_the_selected_precision():
    from torchrig import DistributedType
    from torchrig.utils import PrecisionType

    accelerator = torchrig.Accelerator(cpu=True, mixed_precision="bf16")
    assert accelerator.distributed_type == DistributedType.NO == "NO"
    assert accelerator.mixed_precision == PrecisionType.BF16 == "bf16"
    assert accelerator.state.distributed_type is accelerator.distributed_type
    assert torchrig.state.AcceleratorState().mixed_precision == "bf16"
    accelerator.end_training()


def test_distributed_type_is_open_for_third_party_strategies():
    from torchrig import DistributedType

    member = DistributedType("MULTI_WIDGET")
    assert member == "MULTI_WIDGET" == DistributedType("MULTI_WIDGET") and member.value == "MULTI_WIDGET"
    assert member != DistributedType.MULTI_GPU and DistributedType("FSDP") is DistributedType.FSDP
    assert member not in list(DistributedType)  # never added to the members


def _distributed_type(ctx, strategy):
    with rank_environment(ctx.rank, ctx.world_size):
        from torchrig.state import AcceleratorState, PartialState

        accelerator = torchrig.Accelerator(cpu=True, strategy=strategy)
        seen = (accelerator.distributed_type.value, PartialState().distributed_type.value,
                AcceleratorState().distributed_type.value, accelerator.num_processes,
                AcceleratorState().deepspeed_plugin is not None if strategy == "deepspeed" else None)
        accelerator.end_training()
        return seen


@pytest.mark.multiprocess
@pytest.mark.parametrize(("strategy", "expected"), [
    ("ddp", "MULTI_CPU"), ("fsdp", "FSDP"), ("deepspeed", "DEEPSPEED"), ("localsgd", "MULTI_CPU")])
def test_each_strategy_answers_to_the_member_its_manifest_declares(gloo_pool, strategy, expected):
    results = gloo_pool.run(_distributed_type, strategy, timeout=TIMEOUT)
    assert results == [(expected, expected, expected, 2, True if strategy == "deepspeed" else None)] * 2


# -- PartialState before and without an Accelerator --------------------------------------------


PARTIAL_STATE_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from torchrig import Accelerator, PartialState
    from torchrig.utils import gather_object

    state = PartialState(cpu=True)
    out = {"index": state.process_index, "main": state.is_main_process, "n": state.num_processes,
           "type": state.distributed_type.value}
    order = []
    with state.main_process_first():
        order.append(state.process_index)
    with state.split_between_processes(list(range(5))) as mine:
        out["mine"] = mine
    out["everyone"] = gather_object([state.process_index * 10])
    state.wait_for_everyone()

    @state.on_main_process
    def only_main():
        return "ran"

    out["on_main"] = only_main()
    # an Accelerator created afterwards adopts the same process group, with any strategy
    accelerator = Accelerator(cpu=True, strategy=sys.argv[2])
    out["after"] = accelerator.distributed_type.value
    out["same_state"] = PartialState().process_index == accelerator.process_index
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    accelerator.backward(model(torch.ones(1, 2) * (accelerator.process_index + 1)).sum())
    out["grad"] = accelerator.unwrap_model(model).weight.grad.tolist()
    accelerator.end_training()
    with open(f"{sys.argv[1]}/rank{out['index']}.json", "w") as handle:
        json.dump(out, handle)
""")


def test_partial_state_serves_a_data_preparation_script_then_an_accelerator_on_two_processes(tmp_path,
                                                                                          process_guard):
    script = tmp_path / "prepare_then_train.py"
    script.write_text(PARTIAL_STATE_SCRIPT)
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHRIG_")}
    env.update(TORCHRIG_CONFIG_HOME=str(tmp_path / "config-home"), OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "torchrig", "launch", "--cpu", "--num_processes", "2",
                                 str(script), str(tmp_path), "ddp"], start_new_session=True, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    process_guard.track(launcher)
    output, _ = launcher.communicate(timeout=TIMEOUT)
    assert launcher.returncode == 0, output
    ranks = [json.loads((tmp_path / f"rank{index}.json").read_text()) for index in range(2)]
    assert [r["index"] for r in ranks] == [0, 1] and [r["main"] for r in ranks] == [True, False]
    assert {r["type"] for r in ranks} == {"MULTI_CPU"} and {r["after"] for r in ranks} == {"MULTI_CPU"}
    assert ranks[0]["mine"] == [0, 1, 2] and ranks[1]["mine"] == [3, 4]
    assert ranks[0]["everyone"] == ranks[1]["everyone"] == [0, 10]
    assert ranks[0]["on_main"] == "ran" and ranks[1]["on_main"] is None
    assert all(r["same_state"] for r in ranks)
    assert ranks[0]["grad"] == ranks[1]["grad"] == [[1.5, 1.5]]  # DDP averaged inputs 1 and 2


def test_partial_state_in_one_process_without_an_accelerator():
    state = torchrig.PartialState(cpu=True)
    assert (state.process_index, state.num_processes, state.is_main_process) == (0, 1, True)
    assert state.distributed_type == "NO" and str(state.device) == "cpu"
    with state.split_between_processes({"a": [1, 2, 3]}) as mine:
        assert mine == {"a": [1, 2, 3]}
    with state.main_process_first():
        state.wait_for_everyone()
    assert torchrig.state.is_initialized()


def test_docs_list_every_refusal_and_plugin_provided_name_as_the_table_declares():
    docs = Path(__file__).resolve().parents[2] / "docs"
    sys.path.insert(0, str(docs))
    try:
        from gen_accelerate_reference import BEGIN, END, generated_section
    finally:
        sys.path.remove(str(docs))
    text = (docs / "accelerate.md").read_text()
    current = text[text.index(BEGIN):text.index(END) + len(END)]
    assert current == generated_section(), "docs/accelerate.md is stale: python docs/gen_accelerate_reference.py"
    for module, name, target in entries(Refused):
        assert f"`{torchrig_path(module)}.{name}`" in current or module.startswith("accelerate.utils."), name
        assert target.reason.replace("|", "\\|") in current
