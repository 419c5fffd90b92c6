"""The hook contract documents itself, and the core answers every firstresult hook."""

from __future__ import annotations

import inspect
import pathlib

import pytest
from torchrig.defaults.configuration import ConfigurationDefaults
from torchrig.defaults.process import ProcessDefaults
from torchrig.defaults.training import TrainingDefaults
from torchrig.host.plugin_host import PluginHost
from torchrig.launch.defaults import LaunchDefaults
from torchrig.plugin import hookspecs
from torchrig.plugin.markers import PROJECT_NAME
from torchrig.testing import make_host

REPO = pathlib.Path(__file__).resolve().parents[2]
CORE_FAMILIES = ("core:defaults", "core:process-defaults", "core:training-defaults", "core:launch-defaults")


def _specs():
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        opts = getattr(fn, f"{PROJECT_NAME}_spec", None)
        if opts is not None:
            yield name, fn, opts


SPECS = sorted(_specs(), key=lambda item: item[0])
SPEC_NAMES = [name for name, _, _ in SPECS]


def test_the_catalogue_covers_every_phase():
    expected = {
        "torchrig_config_sections", "torchrig_cli_flags", "torchrig_validate_config",
        "torchrig_detect_cluster", "torchrig_select_device", "torchrig_init_process_group",
        "torchrig_collectives", "torchrig_requeue_command", "torchrig_strategy_capabilities", "torchrig_convert_model",
        "torchrig_prepare_model",
        "torchrig_prepare_dataloader", "torchrig_prepare_scheduler", "torchrig_precision_step_plan",
        "torchrig_strategy_step_plan", "torchrig_wrap_step_plan", "torchrig_save_strategy_state",
        "torchrig_load_strategy_state", "torchrig_full_state_dict", "torchrig_checkpoint_state",
            "torchrig_checkpoint_committed",
        "torchrig_create_trackers", "torchrig_worker_environment", "torchrig_launch", "torchrig_describe_launch",
        "torchrig_configure", "torchrig_unconfigure", "torchrig_estimate_memory",
    }
    assert set(SPEC_NAMES) == expected


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_every_hook_is_documented(name):
    fn = getattr(hookspecs, name)
    doc = inspect.getdoc(fn) or ""
    assert len(doc.splitlines()[0]) > 10, f"{name} needs a one-line summary"
    opts = getattr(fn, f"{PROJECT_NAME}_spec")
    lowered = doc.lower()
    for field in ("phase", "kind", "default"):
        assert f"{field}:" in lowered, f"{name}'s docstring must state its {field}"
    assert "ranks:" in lowered or "ranks" in lowered, f"{name} must say which ranks call it"
    if opts["firstresult"]:
        assert "firstresult" in lowered, f"{name} is firstresult; its docstring must say so"
    elif opts["historic"]:
        assert "historic" in lowered
    else:
        assert "collecting" in lowered, f"{name} is collecting; its docstring must say so"


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_every_hook_appears_in_the_architecture_and_plugin_docs(name):
    text = (REPO / "docs" / "architecture.md").read_text()
    assert name in text, f"docs/architecture.md must map {name}"
    guide = (REPO / "docs" / "plugins.md").read_text()
    signature = str(inspect.signature(getattr(hookspecs, name))).replace("'", "")
    heading = f"#### `{name}{signature}`"
    assert heading in guide, f"docs/plugins.md must document {name} under the heading {heading}"
    section = guide.split(heading, 1)[1].split("\n#### ", 1)[0]
    opts = getattr(getattr(hookspecs, name), f"{PROJECT_NAME}_spec")
    kind = "firstresult" if opts["firstresult"] else "historic" if opts["historic"] else "collecting"
    assert kind in section.lower(), f"docs/plugins.md must give {name}'s kind ({kind})"
    assert "```python" in section and "@hookimpl" in section or "cli_flags" in section, (
        f"docs/plugins.md must show an example implementation of {name}")
    assert name in guide.split("## Call order", 1)[1].split("## The hooks", 1)[0], (
        f"docs/plugins.md's call order must place {name}")


def test_every_firstresult_hook_has_exactly_one_trylast_core_default():
    host = make_host()
    for name, _, opts in SPECS:
        if not opts["firstresult"]:
            continue
        impls = getattr(host.pm.hook, name).get_hookimpls()
        core = [i for i in impls if i.plugin_name in CORE_FAMILIES]
        assert len(core) == 1, f"{name} must have exactly one core default"
        assert core[0].trylast, f"the core default of {name} must be trylast"
        assert not any(i.trylast for i in impls if i.plugin_name not in CORE_FAMILIES), name


def test_core_defaults_implement_only_defined_hooks_each_in_one_family():
    families = [ConfigurationDefaults, ProcessDefaults, TrainingDefaults, LaunchDefaults]
    names = [n for family in families for n in dir(family) if n.startswith("torchrig_")]
    assert set(names) <= set(SPEC_NAMES)
    assert len(names) == len(set(names)), "a hook answered by two core default families"


def test_a_bare_host_registers_only_the_configuration_defaults():
    # The host sits below the runtime: the runtime and launcher register their own families.
    host = PluginHost(environ={})
    assert {name for name, _ in host.pm.list_name_plugin()} & set(CORE_FAMILIES) == {"core:defaults"}


def test_hook_api_version_is_supported():
    assert hookspecs.HOOK_API_VERSION in hookspecs.SUPPORTED_HOOK_API_VERSIONS
