"""Accelerate's module namespaces under torchrig: each mirrored module (``torchrig.state``, ``launchers``,
``data_loader``, ``optimizer``, ``scheduler``, ``tracking``, ``checkpointing``, ``local_sgd``,
``logging``, ``big_modeling``) answers every public name ``dir()`` of Accelerate 1.15's module of the
same path shows — implemented as torchrig's object or refused with why and what to use.

The names come from ``tests/compat/data/accelerate_names.json``, which ``tests/compat/data/gen_accelerate_names.py``
generated from the Accelerate 1.15.0 wheel; these tests run without Accelerate installed. The
generator's own rule is tested here on synthetic modules; set TORCHRIG_ACCELERATE_PYTHON to a Python
that imports Accelerate to regenerate the list and compare it with the committed one.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from torchrig.compat.accelerate_names import ACCELERATE_SOURCE, TABLE
from torchrig.compat.resolve import plugin_export, torchrig_path
from torchrig.compat.targets import FromPlugin, Refused, RefusedNameError
from torchrig.host.discovery import load_reference
from torchrig.testing.scripts import load_script

DATA = Path(__file__).parent / "data"
SNAPSHOT = json.loads((DATA / "accelerate_names.json").read_text())
MIRRORED = ("state", "launchers", "data_loader", "optimizer", "scheduler", "tracking", "checkpointing", "local_sgd",
            "logging", "big_modeling")
TIMEOUT = 300  # seconds the generator may take in a subprocess (not a measurement)

generator = load_script(DATA / "gen_accelerate_names.py")


def test_the_names_come_from_the_accelerate_1_15_release_by_the_written_rule():
    assert SNAPSHOT["source"] == ACCELERATE_SOURCE == "accelerate 1.15.0 (the released wheel)"
    assert SNAPSHOT["rule"] == generator.RULE
    assert set(SNAPSHOT["names"]) == set(generator.MODULES) == {"accelerate", "accelerate.utils"} | {
        f"accelerate.{module}" for module in MIRRORED}
    for module, names in SNAPSHOT["names"].items():
        assert sorted(TABLE[module]) == sorted(names), module
        assert list(SNAPSHOT["origins"][module]) == names, module


def test_the_issues_examples_import_from_accelerates_paths():
    from torchrig.compat.enums import DistributedType as distributed_type
    from torchrig.compat.enums import LoggerType as logger_type
    from torchrig.state import DistributedType
    from torchrig.tracking import LoggerType

    assert DistributedType is distributed_type and LoggerType is logger_type


@pytest.mark.parametrize("module_name", MIRRORED)
def test_every_mirrored_module_answers_every_name_accelerates_dir_shows(module_name):
    accelerate_module = f"accelerate.{module_name}"
    module = importlib.import_module(torchrig_path(accelerate_module))
    names = SNAPSHOT["names"][accelerate_module]
    assert names, accelerate_module
    assert set(names) <= set(dir(module))
    for name in names:
        target = TABLE[accelerate_module][name]
        path = f"{torchrig_path(accelerate_module)}.{name}"
        if isinstance(target, str):
            namespace: dict[str, object] = {}
            exec(f"from {torchrig_path(accelerate_module)} import {name} as imported", namespace)
            assert namespace["imported"] is load_reference(target) is getattr(module, name), path
        elif isinstance(target, Refused):
            with pytest.raises(ImportError) as caught:
                exec(f"from {torchrig_path(accelerate_module)} import {name}", {})
            message = str(caught.value)
            assert path in message and target.reason in message and f"Instead: {target.instead}" in message, message
        else:
            assert isinstance(target, FromPlugin)
            if plugin_export(target.export) is not None or target.fallback is not None:
                assert getattr(module, name) is not None
            else:
                with pytest.raises(RefusedNameError) as caught:
                    getattr(module, name)
                assert target.provided_by in str(caught.value)


def test_a_name_accelerate_re_exports_is_the_object_it_is_at_its_home_path():
    """``accelerate.state.DistributedType`` is ``accelerate.utils.DistributedType``: so are torchrig's."""
    checked = 0
    for module, origins in SNAPSHOT["origins"].items():
        for name, defined_in in origins.items():
            home = "accelerate.utils" if defined_in.startswith("accelerate.utils.") else defined_in
            if home == module or home not in TABLE or name not in TABLE[home]:
                continue
            assert TABLE[module][name] == TABLE[home][name], f"{module}.{name} vs {home}.{name}"
            checked += 1
    assert checked > 130


def test_refused_re_exports_raise_from_every_path():
    for path in ("torchrig.big_modeling.AlignDevicesHook", "torchrig.state.SharedDict",
                 "torchrig.data_loader.MpDeviceLoaderWrapper", "torchrig.tracking.LOGGER_TYPE_TO_CLASS"):
        module, name = path.rsplit(".", 1)
        with pytest.raises(RefusedNameError, match=f"torchrig does not provide {path}.*Instead: "):
            getattr(importlib.import_module(module), name)


def test_torch_objects_accelerate_re_exports_are_torchs_own():
    import safetensors.torch
    import torch
    from torchrig.checkpointing import GradScaler, load_model
    from torchrig.data_loader import BatchSampler, DataLoader

    assert (DataLoader, BatchSampler, GradScaler, load_model) == (
        torch.utils.data.DataLoader, torch.utils.data.BatchSampler, torch.amp.GradScaler, safetensors.torch.load_model)


# -- the generator's rule, on synthetic modules (no Accelerate needed) --------------------------------


def test_standard_library_plumbing_is_left_out_and_data_and_aliases_are_kept():
    plumbing = {"Any": typing.Any, "Optional": typing.Optional, "Callable": typing.Callable,
                "contextmanager": __import__("contextlib").contextmanager, "Path": Path,
                "annotations": __import__("__future__").annotations, "logger": logging.getLogger("x"),
                "adapter": logging.LoggerAdapter(logging.getLogger("x"), {})}
    for name, value in plumbing.items():
        assert generator.is_stdlib_plumbing(name, value), name
    kept = {"SharedDict": dict, "MODEL_NAME": "pytorch_model", "LOGGER_TYPE_TO_CLASS": {"a": 1},
            "SUPPORTED": (object,), "DataLoader": pytest.importorskip("torch").utils.data.DataLoader}
    for name, value in kept.items():
        assert not generator.is_stdlib_plumbing(name, value), name


def test_branch_only_names_count_and_loop_variables_do_not(tmp_path):
    package = tmp_path / "fakepkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "helper.py").write_text("")
    (package / "mod.py").write_text(
        "import os\n"
        "from typing import Any\n"
        "if os.environ.get('NEVER_SET_FOR_THIS_TEST'):\n"
        "    from .sub import helper\n"
        "    from torch_xla import XlaThing\n"
        "    from functools import partial\n"
        "    class OnlyWithXla: ...\n"
        "    XLA_CONSTANT = 1\n"
        "for v, extra in [('a', {})]:\n"
        "    pass\n"
        "PUBLIC = 'x'\n"
        "_private = 1\n"
        "def function(): ...\n")
    sys.path.insert(0, str(tmp_path))
    try:
        names = generator.public_names("fakepkg.mod")
    finally:
        sys.path.remove(str(tmp_path))
        for name in [name for name in sys.modules if name.startswith("fakepkg")]:
            del sys.modules[name]
    assert names == {"OnlyWithXla": "?", "PUBLIC": "fakepkg.mod", "XLA_CONSTANT": "?", "XlaThing": "?",
                     "function": "fakepkg.mod"}


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.environ.get("TORCHRIG_ACCELERATE_PYTHON"),
                    reason="set TORCHRIG_ACCELERATE_PYTHON to a Python that imports accelerate 1.15.0")
def test_the_committed_list_is_what_the_generator_lists_from_accelerate(tmp_path):
    output = tmp_path / "names.json"
    subprocess.run([os.environ["TORCHRIG_ACCELERATE_PYTHON"], str(DATA / "gen_accelerate_names.py"),
                    "--output", str(output)], check=True, timeout=TIMEOUT, cwd=tmp_path, capture_output=True)
    assert json.loads(output.read_text()) == SNAPSHOT
