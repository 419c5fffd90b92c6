"""torchrig.plugin is the one import home of the plugin API (issue 35, "One public plugin API").

Plugins (``plugins/*/src``) and the example third-party plugin (``examples/localsgd/src``) import
torchrig only through :mod:`torchrig.plugin`; every name it exports resolves and is documented in
docs/plugins.md; importing it imports no torchrig module (so no torch) until a name is used.
"""

from __future__ import annotations

import ast
import functools
import importlib
import pathlib
import re

import pytest
import torchrig.plugin
from torchrig.cli.new_plugin import render

ROOT = pathlib.Path(__file__).resolve().parents[2]
PLUGIN_SOURCES = sorted([*ROOT.glob("plugins/*/src"), ROOT / "examples" / "localsgd" / "src"])
API_MODULE = "torchrig.plugin"


def _torchrig_imports(tree: ast.AST) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import of torchrig in ``tree``, at any depth (function
    bodies and ``if TYPE_CHECKING:`` blocks included)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "torchrig" or node.module.startswith("torchrig."):
                found.append((node.lineno, node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names
                      if alias.name == "torchrig" or alias.name.startswith("torchrig.")]
    return found


def _plugin_files() -> list[pathlib.Path]:
    return [path for source in PLUGIN_SOURCES for path in sorted(source.rglob("*.py"))]


@functools.cache
def _parsed(path: pathlib.Path) -> ast.Module:
    """Each plugin module parsed once for the checks below."""
    return ast.parse(path.read_text(), str(path))


def test_plugin_sources_import_torchrig_only_through_the_plugin_api() -> None:
    assert len(PLUGIN_SOURCES) >= 7, PLUGIN_SOURCES  # ddp, fsdp, deepspeed, trackers, ray, fp8 + the example
    offences = []
    for path in _plugin_files():
        for line, module, names in _torchrig_imports(_parsed(path)):
            where = f"{path.relative_to(ROOT)}:{line}"
            if module != API_MODULE:
                imported = f"from {module} import {', '.join(names)}" if names else f"import {module}"
                offences.append(f"{where}: `{imported}` — import it from torchrig.plugin (add it to "
                                f"torchrig.plugin._API and docs/plugins.md if it is API)")
            else:
                offences += [f"{where}: torchrig.plugin has no name {name!r}" for name in names
                             if name not in torchrig.plugin.__all__]
    assert not offences, "plugins import torchrig outside its plugin API:\n" + "\n".join(offences)


def test_the_api_check_sees_imports_at_any_depth() -> None:
    """The check reads function-level and TYPE_CHECKING imports too (what a plugin would hide there)."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from torchrig.host.run import RunContext\n"
              "def f():\n    import torchrig.config.schema\n")
    assert [(line, module) for line, module, _ in _torchrig_imports(ast.parse(source))] == [
        (3, "torchrig.host.run"), (5, "torchrig.config.schema")]


def test_every_api_name_resolves() -> None:
    assert torchrig.plugin.__all__ == sorted(torchrig.plugin._API)
    for name in torchrig.plugin.__all__:
        module, _, attribute = torchrig.plugin._API[name].partition(":")
        assert getattr(torchrig.plugin, name) is getattr(importlib.import_module(module), attribute or name), name
    with pytest.raises(AttributeError, match=r"no attribute 'RunStatus'.*torchrig\.plugin\.__all__"):
        torchrig.plugin.RunStatus  # noqa: B018


def test_every_api_name_is_documented_in_the_plugin_guide() -> None:
    guide = (ROOT / "docs" / "plugins.md").read_text()
    section = guide.split("## The plugin API", 1)
    assert len(section) == 2, "docs/plugins.md has no section '## The plugin API'"
    table = section[1].split("\n## ", 1)[0]
    first_cells = re.findall(r"^\| ([^|]+) \|", table, re.MULTILINE)
    rows = {name for cell in first_cells for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", cell)}
    assert sorted(set(torchrig.plugin.__all__) - rows) == [], "undocumented in docs/plugins.md's API table"
    assert sorted(rows - set(torchrig.plugin.__all__)) == [], "documented but not exported by torchrig.plugin"


def test_the_api_package_imports_no_torchrig_module() -> None:
    """Names resolve on first use (PEP 562): a manifest importing torchrig.plugin pays for nothing
    it does not use, and ``torchrig --help`` never imports torch through it."""
    init = pathlib.Path(torchrig.plugin.__file__)
    runtime_imports = []
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            continue
        runtime_imports += [module for _, module, _ in _torchrig_imports(node)]
    assert runtime_imports == []


@pytest.mark.parametrize("kind", ["strategy", "precision", "device", "tracker", "cluster"])
def test_new_plugin_templates_import_only_the_plugin_api_and_read_typed_sections(kind: str) -> None:
    """What ``torchrig new-plugin`` renders is what third parties start from: the one import home
    and the one way to read configuration."""
    offences = []
    for path, text in render("acme", kind).items():
        if path.startswith("src/") and path.endswith(".py"):
            tree = ast.parse(text, path)
            offences += [f"{path}:{line}: {module}" for line, module, _ in _torchrig_imports(tree) if module != API_MODULE]
            offences += [f"{path}:{line}: {what}" for line, what in _other_config_idioms(tree)]
    assert not offences, offences


#: A hook's configuration in plugin code: ``run.config`` (runtime hooks), the ``config`` argument of
#: ``torchrig_validate_config`` and ``request.config`` (memory estimates), all a ResolvedConfig. A
#: plain dict that is data (DeepSpeed's JSON) is named for what it holds (``ds_json``), not ``config``.
_RUN_CONFIG = re.compile(r"^(config|.*\brun\.config|.*\brequest\.config)$")
_TYPED_READ = {"run": "read run.section(YourOptions).<field>",
               "hook": "read config.section_of(YourOptions).<field> (config.is_set(key): did a source set it)"}


def _config_read_hint(target: str) -> str | None:
    """What to read instead when ``target`` (source text) is a run's configuration, else None."""
    if not _RUN_CONFIG.match(target):
        return None
    return _TYPED_READ["run" if target.endswith("run.config") else "hook"]


def _other_config_idioms(tree: ast.AST) -> list[tuple[int, str]]:
    """Reading configuration any other way than its typed section: ``run.option(...)``, a dotted-key
    read of a ResolvedConfig (``run.config[...]``, ``config.get(...)`` in a validation hook,
    ``request.config.get(...)`` in a memory estimate, or ``get = config.get``), and
    ``getattr(..., "is_set", ...)`` probes."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = ast.unparse(node.func.value)
            if node.func.attr == "option" and target.split(".")[-1] == "run":
                found.append((node.lineno, f"{ast.unparse(node)} — read run.section(YourOptions).<field>"))
        if isinstance(node, ast.Attribute) and node.attr == "get":
            hint = _config_read_hint(ast.unparse(node.value))
            if hint:
                found.append((node.lineno, f"{ast.unparse(node)}(...) — {hint}"))
        elif isinstance(node, ast.Subscript):
            hint = _config_read_hint(ast.unparse(node.value))
            if hint:
                found.append((node.lineno, f"{ast.unparse(node)} — {hint}"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "is_set"):
            found.append((node.lineno, f"{ast.unparse(node)} — run.config is a ResolvedConfig: call .is_set(key)"))
    return found


def test_the_configuration_check_sees_dotted_reads_in_validation_and_memory_hooks() -> None:
    """What the hooks that receive a ResolvedConfig must not do, and what stays allowed: the typed
    section, ``is_set``, and dict reads of data that is not the run's configuration."""
    source = ("def torchrig_validate_config(config):\n    a = config.get('x.y', 1)\n    b = config['x.z']\n"
              "    get = config.get\n"
              "def estimate(request):\n    return request.config.get('ddp_config.gradient_as_bucket_view')\n"
              "def fine(config, request, ds_json, record):\n    options = config.section_of(Options)\n"
              "    return (config.is_set('x.y'), request.config.section_of(Options).z, ds_json.get('fp16'),\n"
              "            ds_json['zero_optimization'], record.built.config)\n")
    assert sorted(line for line, _ in _other_config_idioms(ast.parse(source))) == [2, 3, 4, 6]


def test_plugin_sources_read_configuration_through_typed_sections() -> None:
    offences = [f"{path.relative_to(ROOT)}:{line}: {what}" for path in _plugin_files()
                for line, what in _other_config_idioms(_parsed(path))]
    assert not offences, "plugins read configuration outside run.section(Options):\n" + "\n".join(offences)
