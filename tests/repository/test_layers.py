"""The house rules of the core's layout, checked: every module sits in a layer of the import-linter contract,
the layer diagram in docs/architecture.md is generated from that contract, the top level holds only what
``torchrig/__init__.py``'s docstring allows, and the module paths of 0.1 still import (with a warning)."""

from __future__ import annotations

import ast
import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest
from torchrig.compat.accelerate_names import TABLE as ACCELERATE_MODULES
from torchrig.compat.moved_modules import MOVED_MODULES
from torchrig.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "core" / "src" / "torchrig"
gen_layer_diagram = load_script(ROOT / "docs" / "gen_layer_diagram.py")  # docs/ is not a package: a script

#: the top level's own files, beside the concept packages and Accelerate's paths
OWN_FILES = {"__init__.py", "__main__.py", "_version.py", "py.typed", "errors.py"}
TOP_LEVEL_BUDGET = 28  # issue 35: "at most ~27"; 18 concept packages, 9 Accelerate paths, errors


def core_modules() -> dict[str, Path]:
    modules = {}
    for path in CORE.rglob("*.py"):
        parts = path.relative_to(CORE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def imports_torchrig(path: Path) -> bool:
    """Whether the module imports a torchrig module when it runs (``if TYPE_CHECKING:`` blocks are
    annotations, not dependencies: torchrig.plugin's lazy table names its types there)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torchrig":
            return True
        if isinstance(node, ast.Import) and any(alias.name.split(".")[0] == "torchrig" for alias in node.names):
            return True
    return False


def test_every_module_of_the_core_sits_in_a_layer():
    entries = [entry for layer in gen_layer_diagram.layers() for entry in layer]
    unplaced = []
    for name, path in core_modules().items():
        if not name:  # torchrig/__init__.py: the container itself
            continue
        if any(name == entry or name.startswith(entry + ".") for entry in entries):
            continue
        if path.name == "__init__.py" and not imports_torchrig(path):
            continue  # a package whose modules sit at different heights; its __init__ imports no torchrig module
        unplaced.append(name)
    assert not unplaced, (f"modules in no layer of the import-linter contract in pyproject.toml: {sorted(unplaced)}; "
                          "add each to the layer it belongs to (docs/architecture.md, 'Layers')")


def test_each_layer_entry_names_a_module_that_exists():
    modules = core_modules()
    missing = [entry for layer in gen_layer_diagram.layers() for entry in layer if entry not in modules]
    assert not missing, f"layer entries naming no module of the core: {missing}"


def test_the_layer_diagram_in_the_architecture_document_is_generated_from_the_contract():
    text = gen_layer_diagram.DOCUMENT.read_text()
    assert gen_layer_diagram.document_block(text) == gen_layer_diagram.block(), (
        "docs/architecture.md's layer diagram is stale: run `python docs/gen_layer_diagram.py --write`")


def test_the_top_level_holds_concept_packages_accelerates_paths_and_errors_only():
    accelerate_paths = {name.split(".", 1)[1] for name in ACCELERATE_MODULES if name.count(".") == 1}
    strays, entries = [], []
    for path in sorted(CORE.iterdir()):
        if path.name == "__pycache__":
            continue
        entries.append(path.name)
        if path.is_dir():
            if not (path / "__init__.py").exists():
                strays.append(f"{path.name}/ (a directory that is not a package)")
        elif path.name not in OWN_FILES and path.stem not in accelerate_paths:
            strays.append(path.name)
    assert not strays, (f"top-level entries the rule in torchrig/__init__.py does not allow: {strays}; put the module "
                        "into the concept package it belongs to")
    named = [entry for entry in entries if not entry.startswith("_") and entry != "py.typed"]
    assert len(named) <= TOP_LEVEL_BUDGET, f"{len(named)} top-level entries (budget {TOP_LEVEL_BUDGET}): {named}"
    docstring = ast.get_docstring(ast.parse((CORE / "__init__.py").read_text()))
    undocumented = [entry for entry in named if f"``{Path(entry).stem}``" not in docstring]
    assert not undocumented, f"top-level entries torchrig/__init__.py's rule does not name: {undocumented}"


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_path_imports_the_same_module_with_a_deprecation_warning(old):
    new = importlib.import_module(MOVED_MODULES[old])
    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        aliased = importlib.import_module(old)
    assert aliased is new
    assert new.__spec__.name == MOVED_MODULES[old], "the alias must not rename the real module"
    assert [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and old in str(w.message)], (
        f"importing {old} gave no DeprecationWarning naming it")


def test_nothing_in_the_repository_imports_a_moved_path():
    moved = "|".join(re.escape(old) for old in MOVED_MODULES)
    pattern = re.compile(rf"^\s*(?:from ({moved}) import|import ({moved})\b)", re.M)
    skipped = {"build", "__pycache__", ".git", ".venv", "torchrig_logs"}
    offenders = []
    for top in ("core", "plugins", "examples", "tests", "benchmarks", "docs"):
        for path in (ROOT / top).rglob("*.py"):
            if skipped.isdisjoint(path.relative_to(ROOT).parts) and path.name != "test_layers.py":
                offenders += [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for m in pattern.finditer(path.read_text())]
    assert not offenders, f"imports of paths that moved in 0.2 (use the new path): {offenders}"


def test_the_changelog_lists_every_moved_path():
    changelog = (ROOT / "docs" / "changelog.md").read_text()
    missing = [old for old, new in MOVED_MODULES.items() if f"| `{old}` | `{new}` |" not in changelog]
    assert not missing, f"docs/changelog.md does not list these moves: {missing}"
