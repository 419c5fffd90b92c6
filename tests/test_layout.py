"""The house rules of the test suite's layout, checked (CONTRIBUTING.md, "A test"): helpers are imported, never
reached by patching ``sys.path``, and the tiny models tests share are defined once, in ``torchrig.testing.models``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: every distribution's test folder: the core's, each plugin's, the example third-party plugin's
TEST_FOLDERS = [ROOT / "tests", *sorted((ROOT / "plugins").glob("*/tests")), *sorted((ROOT / "examples").glob("*/tests"))]

#: the models of :mod:`torchrig.testing.models`: one name, one network, everywhere
SHARED_MODELS = ("TinyTransformer", "TinyLM", "PipeLM", "CompileStack")


def python_files() -> Iterator[Path]:
    for folder in TEST_FOLDERS:
        yield from sorted(folder.rglob("*.py"))


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
               for path in python_files()
               for node in module_level_statements(ast.parse(path.read_text()).body) if changes_sys_path(node)]
    assert not patched, (
        "test modules that change sys.path when imported (every later import of the run sees the folder): "
        f"{patched}; import a shared helper from torchrig.testing (models, hf_models, peft_lora), a plugin's own "
        "helper as a sibling module of its tests, or a script by path with torchrig.testing.scripts.load_script")


def test_the_shared_tiny_models_are_defined_only_in_the_test_kit():
    redefined = [f"{path.relative_to(ROOT)}:{node.lineno}: class {node.name}"
                 for path in python_files()
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.ClassDef) and node.name in SHARED_MODELS]
    assert not redefined, (f"classes named after a model of torchrig.testing.models, defined again: {redefined}; "
                           "import it (`from torchrig.testing.models import ...`), or give a different network a "
                           "name of its own")
