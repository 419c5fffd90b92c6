"""Plugin discovery, selection and its errors — from fake distributions, nothing installed."""

from __future__ import annotations

import sys

import pytest
from torchrig import hookimpl
from torchrig.errors import (
    PluginAPIVersionError,
    PluginConflictError,
    PluginDisabledError,
    PluginImportError,
    PluginNotFoundError,
)
from torchrig.host.discovery import GROUP_HEADER, installed_distributions, scan
from torchrig.host.plugin_host import PluginStatus
from torchrig.plugin.hookspecs import HOOK_API_VERSION
from torchrig.plugin.kinds import GROUPS
from torchrig.plugin.manifest import PluginManifest
from torchrig.plugin.types import Capabilities, CliFlag
from torchrig.testing import FakeDistribution, make_host, plugin_distribution


class GoodManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    summary = "a test strategy"


class FutureManifest(PluginManifest):
    api_version = 99


class NeedsMissingModule(PluginManifest):
    api_version = HOOK_API_VERSION
    requires = ("torchrig_no_such_dependency_xyz",)
    install_hint = "torchrig[imaginary]"


class FlagManifest(PluginManifest):
    api_version = HOOK_API_VERSION
    cli_flags = (CliFlag("--zz_level", "zz.level", type="int"),)


class Strategy:
    """Counts instances, to prove each host gets its own plugin object."""

    instances = 0

    def __init__(self) -> None:
        type(self).instances += 1

    @hookimpl
    def torchrig_strategy_capabilities(self, run):
        return Capabilities(owns_accumulation=True)


@pytest.fixture
def mods(fake_modules):
    fake_modules.add(
        "tr_fake_plugin",
        GoodManifest=GoodManifest,
        FutureManifest=FutureManifest,
        NeedsMissingModule=NeedsMissingModule,
        FlagManifest=FlagManifest,
        Strategy=Strategy,
        NotAManifest=object,
        not_callable=42,
    )
    return fake_modules


def strategy_dist(dist: str, name: str = "zz", version: str = "1.0", runtime: str | None = "tr_fake_plugin:Strategy",
                  manifest: str | None = "tr_fake_plugin:GoodManifest") -> FakeDistribution:
    return plugin_distribution(dist, version, [("strategy", name, runtime, manifest)])


def test_fake_distribution_plugin_is_discovered_available_and_selectable(mods):
    host = make_host(strategy_dist("zz-plugin"))
    info = host.info("strategy", "zz")
    assert info.status is PluginStatus.AVAILABLE
    assert (info.record.distribution, info.record.version) == ("zz-plugin", "1.0")
    assert host.pm.has_plugin("strategy:zz#manifest")
    runtime = host.select("strategy", "zz")
    assert isinstance(runtime, Strategy)
    assert host.pm.get_plugin("strategy:zz") is runtime
    assert info.status is PluginStatus.SELECTED


def test_discovery_imports_no_runtime_module(mods):
    host = make_host(strategy_dist("zz-plugin", runtime="tr_never_imported_module:Strategy"))
    assert "tr_never_imported_module" not in sys.modules
    assert host.info("strategy", "zz").status is PluginStatus.AVAILABLE


def test_each_host_instantiates_its_own_plugin_objects(mods):
    first, second = make_host(strategy_dist("zz-plugin")), make_host(strategy_dist("zz-plugin"))
    before = Strategy.instances
    a, b = first.select("strategy", "zz"), second.select("strategy", "zz")
    assert a is not b
    assert Strategy.instances == before + 2


def test_same_name_from_two_distributions_is_a_conflict_naming_both(mods):
    host = make_host(strategy_dist("zz-one", version="1.0"), strategy_dist("zz-two", version="2.5"))
    info = host.info("strategy", "zz")
    assert info.status is PluginStatus.CONFLICT
    assert "zz-one 1.0" in info.reason and "zz-two 2.5" in info.reason
    with pytest.raises(PluginConflictError) as excinfo:
        host.select("strategy", "zz")
    message = str(excinfo.value)
    for expected in ("zz-one 1.0", "zz-two 2.5", "'zz@zz-one'", "pip uninstall zz-two"):
        assert expected in message
    # Conflicting manifests are not registered: neither silently wins.
    assert not host.pm.has_plugin("strategy:zz#manifest")


def test_conflict_resolved_by_choosing_the_distribution(mods):
    host = make_host(strategy_dist("zz-one"), strategy_dist("zz-two"))
    runtime = host.select("strategy", "zz@zz-two")
    assert isinstance(runtime, Strategy)
    assert host.info("strategy", "zz").record.distribution == "zz-two"
    with pytest.raises(PluginNotFoundError, match="not provided by distribution 'zz-three'"):
        make_host(strategy_dist("zz-one"), strategy_dist("zz-two")).select("strategy", "zz@zz-three")


def test_same_name_in_different_kinds_is_not_a_conflict(mods):
    dist = plugin_distribution(
        "zz-plugin", "1.0",
        [("strategy", "zz", "tr_fake_plugin:Strategy", "tr_fake_plugin:GoodManifest"),
         ("tracker", "zz", "tr_fake_plugin:Strategy", "tr_fake_plugin:GoodManifest")],
    )
    host = make_host(dist)
    assert host.info("strategy", "zz").status is PluginStatus.AVAILABLE
    assert host.info("tracker", "zz").status is PluginStatus.AVAILABLE


def test_shadowed_copy_of_one_distribution_is_not_a_conflict(mods):
    # importlib.metadata can list one distribution twice (editable + stale copy); the first wins.
    from torchrig.host.discovery import scan

    records = scan([strategy_dist("zz-plugin"), strategy_dist("zz-plugin")])
    assert len(records) == 1


def test_missing_dependency_of_selected_plugin_gives_pip_command(mods):
    host = make_host(strategy_dist("zz-plugin", manifest="tr_fake_plugin:NeedsMissingModule"))
    info = host.info("strategy", "zz")
    assert info.status is PluginStatus.UNAVAILABLE
    with pytest.raises(PluginImportError) as excinfo:
        host.select("strategy", "zz")
    message = str(excinfo.value)
    assert "strategy plugin 'zz'" in message
    assert "zz-plugin 1.0" in message
    assert "torchrig_no_such_dependency_xyz" in message
    assert "pip install 'torchrig[imaginary]'" in message


def test_runtime_import_failure_names_plugin_distribution_cause_and_fix(mods):
    host = make_host(strategy_dist("zz-plugin", runtime="tr_fake_missing_runtime_mod:Strategy"))
    with pytest.raises(PluginImportError) as excinfo:
        host.select("strategy", "zz")
    message = str(excinfo.value)
    assert "strategy plugin 'zz'" in message
    assert "zz-plugin 1.0" in message
    assert "ModuleNotFoundError" in message and "tr_fake_missing_runtime_mod" in message
    assert "pip install 'zz-plugin'" in message
    assert isinstance(excinfo.value.__cause__, ModuleNotFoundError)


def test_runtime_entry_that_is_not_callable_is_a_clear_error(mods):
    host = make_host(strategy_dist("zz-plugin", runtime="tr_fake_plugin:not_callable"))
    with pytest.raises(PluginImportError, match="not a class or factory"):
        host.select("strategy", "zz")


def test_api_version_mismatch_is_reported_at_discovery_and_refused_at_selection(mods):
    host = make_host(strategy_dist("zz-plugin", manifest="tr_fake_plugin:FutureManifest"))
    info = host.info("strategy", "zz")
    assert info.status is PluginStatus.UNAVAILABLE
    assert "hook API version 99" in info.reason
    with pytest.raises(PluginAPIVersionError, match="hook API version 99"):
        host.select("strategy", "zz")


@pytest.mark.parametrize(
    ("runtime", "manifest", "reason"),
    [
        ("tr_fake_plugin:Strategy", None, "no manifest entry point"),
        (None, "tr_fake_plugin:GoodManifest", "no runtime entry point"),
        ("tr_fake_plugin:Strategy", "tr_fake_plugin:NotAManifest", "not a torchrig.PluginManifest subclass"),
        ("tr_fake_plugin:Strategy", "tr_fake_broken_manifest_mod:M", "failed to import"),
    ],
)
def test_incomplete_or_broken_plugins_are_unavailable_with_reason(mods, runtime, manifest, reason):
    host = make_host(strategy_dist("zz-plugin", runtime=runtime, manifest=manifest))
    info = host.info("strategy", "zz")
    assert info.status is PluginStatus.UNAVAILABLE
    assert reason in info.reason
    with pytest.raises(PluginImportError, match=reason):
        host.select("strategy", "zz")


def test_a_broken_plugin_does_not_break_the_others(mods):
    host = make_host(strategy_dist("zz-broken", name="broken", manifest="tr_fake_broken_manifest_mod:M"),
                     strategy_dist("zz-plugin"))
    assert host.info("strategy", "broken").status is PluginStatus.UNAVAILABLE
    assert isinstance(host.select("strategy", "zz"), Strategy)


def test_unknown_name_suggests_the_closest(mods):
    host = make_host(strategy_dist("zz-plugin", name="localsgd"))
    with pytest.raises(PluginNotFoundError) as excinfo:
        host.select("strategy", "localsdg")
    assert "did you mean 'localsgd'?" in str(excinfo.value)
    assert "single" in str(excinfo.value)  # lists what is installed


@pytest.mark.parametrize("disabled", ["strategy:zz", "zz", "tracker:nothing, zz"])
def test_disabled_by_argument(mods, disabled):
    host = make_host(strategy_dist("zz-plugin"), disabled=[disabled])
    assert host.info("strategy", "zz").status is PluginStatus.DISABLED
    assert not host.pm.has_plugin("strategy:zz#manifest")
    with pytest.raises(PluginDisabledError, match="disabled"):
        host.select("strategy", "zz")


def test_disabled_by_environment_variable(mods):
    host = make_host(strategy_dist("zz-plugin"), environ={"TORCHRIG_DISABLE_PLUGINS": "strategy:zz"})
    assert host.info("strategy", "zz").status is PluginStatus.DISABLED
    assert make_host(strategy_dist("zz-plugin")).info("strategy", "zz").status is PluginStatus.AVAILABLE


def test_disabled_list_with_unknown_kind_is_an_error(mods):
    with pytest.raises(ValueError, match="unknown plugin kind 'strategi'"):
        make_host(disabled=["strategi:zz"])


def test_scan_skipping_on_the_raw_text_finds_what_parsing_every_distribution_finds():
    """The scan skips a distribution whose ``entry_points.txt`` has no ``[torchrig.`` header
    without parsing it; what it finds must equal a full parse of every distribution's entry points."""
    assert all(f"[{group}]".startswith(GROUP_HEADER) for group in GROUPS)
    dists = installed_distributions()
    parsed = {(dist.metadata["Name"], ep.group, ep.name, ep.value) for dist in dists for ep in dist.entry_points
              if ep.group in GROUPS}
    found = set()
    for record in scan(dists):
        kind = record.kind
        if record.runtime is not None:
            found.add((record.distribution, kind.runtime_group, record.name, record.runtime))
        if record.manifest is not None:
            found.add((record.distribution, kind.manifest_group, record.name, record.manifest))
    assert found == parsed and parsed


def test_core_builtins_are_discovered_through_entry_points():
    host = make_host()
    expected = {("strategy", "single"), ("precision", "no"), ("precision", "fp16"), ("precision", "bf16"),
                ("device", "cpu"), ("device", "cuda"), ("device", "mps")}
    found = {(i.kind.value, i.name) for i in host.plugins() if i.record and i.record.distribution == "torchrig"}
    assert expected <= found
    for kind, name in expected:
        assert host.info(kind, name).status is PluginStatus.AVAILABLE


def test_plugin_with_unknown_hook_is_caught_by_check_pending(mods, fake_modules):
    class Typo:
        @hookimpl
        def torchrig_strategy_capabilites(self, run):  # misspelled hook
            return None

    fake_modules.add("tr_fake_typo", Typo=Typo)
    host = make_host(strategy_dist("zz-plugin", runtime="tr_fake_typo:Typo"))
    host.select("strategy", "zz")
    from torchrig.errors import PluginError

    with pytest.raises(PluginError, match="torchrig_strategy_capabilites"):
        host.check_pending()


def test_manifest_hooks_are_torch_free_and_contribute_flags(mods):
    host = make_host(strategy_dist("zz-plugin", manifest="tr_fake_plugin:FlagManifest"))
    flags = [flag for group in host.hook.torchrig_cli_flags() for flag in group]
    assert CliFlag("--zz_level", "zz.level", type="int") in flags
