"""The house rules of the test suite's layout, checked (CONTRIBUTING.md, "A test"): the core's tests mirror its
packages (``tests/<package>/test_<module-or-topic>.py``, plus ``end_to_end/`` and ``repository/``), helpers are
imported, never reached by patching ``sys.path``, and the tiny models tests share are defined once, in
``torchrig.testing.models``.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
CORE = ROOT / "core" / "src" / "torchrig"

#: folders of tests/ that are not a package of the core: whole user workflows, and checks of the whole repository
OTHER_FOLDERS = {
    "end_to_end": "user workflows across packages: Accelerate's examples and no_trainer scripts, torchrig's examples, "
                  "PEFT/QLoRA, the GPU tier",
    "repository": "checks of the whole repository: lint, layers, this layout, docs, packaging, wheels, benchmarks",
}

#: every distribution's test folder: the core's, each plugin's, the example third-party plugin's
TEST_FOLDERS = [ROOT / "tests", *sorted((ROOT / "plugins").glob("*/tests")), *sorted((ROOT / "examples").glob("*/tests"))]

#: the models of :mod:`torchrig.testing.models`: one name, one network, everywhere
SHARED_MODELS = ("TinyTransformer", "TinyLM", "PipeLM", "CompileStack")


@functools.cache
def parsed_files() -> tuple[tuple[Path, ast.Module], ...]:
    """Every Python file of the test folders, parsed once for both checks below."""
    return tuple((path, ast.parse(path.read_text())) for folder in TEST_FOLDERS for path in sorted(folder.rglob("*.py")))


def module_level_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when the module is imported (inside module-level ``try``/``if``/``with`` too)."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            if isinstance(node, (ast.Try, ast.If, ast.With)) or (field == "body" and isinstance(node, ast.ExceptHandler)):
                yield from module_level_statements(getattr(node, field, []))


def changes_sys_path(node: ast.stmt) -> bool:
    text = ast.unparse(node)
    return text.startswith(("sys.path.insert(", "sys.path.append(", "sys.path.extend(", "sys.path[", "sys.path ="))


def test_no_test_module_patches_sys_path_when_imported():
    patched = [f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}"
               for path, tree in parsed_files()
               for node in module_level_statements(tree.body) if changes_sys_path(node)]
    assert not patched, (
        "test modules that change sys.path when imported (every later import of the run sees the folder): "
        f"{patched}; import a shared helper from torchrig.testing (models, hf_models, peft_lora), a plugin's own "
        "helper as a sibling module of its tests, or a script by path with torchrig.testing.scripts.load_script")


def test_the_shared_tiny_models_are_defined_only_in_the_test_kit():
    redefined = [f"{path.relative_to(ROOT)}:{node.lineno}: class {node.name}"
                 for path, tree in parsed_files()
                 for node in ast.walk(tree)
                 if isinstance(node, ast.ClassDef) and node.name in SHARED_MODELS]
    assert not redefined, (f"classes named after a model of torchrig.testing.models, defined again: {redefined}; "
                           "import it (`from torchrig.testing.models import ...`), or give a different network a "
                           "name of its own")


def core_packages() -> list[str]:
    return sorted(path.parent.name for path in CORE.glob("*/__init__.py"))


def where_it_belongs(name: str) -> str:
    """``test_checkpoint_numbering.py`` -> ``tests/checkpoint/test_numbering.py``; otherwise the choice of folders."""
    topic = name.removeprefix("test_")
    for package in sorted(core_packages(), key=len, reverse=True):
        if topic == package + ".py":
            return f"tests/{package}/{name}"
        if topic.startswith(package + "_"):
            return f"tests/{package}/test_{topic.removeprefix(package + '_')}"
    return f"tests/<package>/{name}, <package> one of {core_packages()} (or {sorted(OTHER_FOLDERS)})"


def test_every_core_test_sits_in_a_folder_named_after_a_package_of_the_core():
    allowed = set(core_packages()) | set(OTHER_FOLDERS)
    misplaced = []
    for path in sorted(TESTS.rglob("test_*.py")):
        parts = path.relative_to(TESTS).parts
        if len(parts) == 1:
            misplaced.append(f"tests/{path.name} is not in a package's folder: move it to {where_it_belongs(path.name)}")
        elif parts[0] not in allowed:
            misplaced.append(f"tests/{parts[0]}/ names no package of core/src/torchrig: move {path.name} to "
                             f"{where_it_belongs(path.name)}")
        elif len(parts) > 2:
            misplaced.append(f"{path.relative_to(ROOT)}: a test sits directly in tests/<package>/ (a deeper folder "
                             "holds support files only)")
    assert not misplaced, "the core's tests mirror its packages (CONTRIBUTING.md, 'A test'):\n" + "\n".join(misplaced)


def test_every_test_folder_is_a_package_so_equal_file_names_do_not_collide():
    """pytest imports ``tests/checkpoint/test_x.py`` as ``tests.checkpoint.test_x`` only if both folders have an
    ``__init__.py``; without one two ``test_x.py`` in different folders clash at collection."""
    missing = [str(folder.relative_to(ROOT)) for folder in [TESTS, *(TESTS / name for name in
               sorted({path.relative_to(TESTS).parts[0] for path in TESTS.glob("*/test_*.py")}))]
               if not (folder / "__init__.py").is_file()]
    assert not missing, f"test folders without an __init__.py: {missing}; add an empty one (a one-line docstring)"
