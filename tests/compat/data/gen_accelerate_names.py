"""List the public names of Accelerate's modules, from an installed Accelerate, for the compatibility table.

    python -m venv --system-site-packages /tmp/accvenv
    /tmp/accvenv/bin/pip install --no-deps accelerate-1.15.0-py3-none-any.whl
    /tmp/accvenv/bin/python tests/compat/data/gen_accelerate_names.py

Run it with a Python that imports the Accelerate release to list (never the project's own environment:
Accelerate there would only confuse the tests). It writes ``tests/compat/data/accelerate_names.json``, which
``tests/compat/test_accelerate_names.py`` and ``tests/compat/test_accelerate_namespaces.py`` compare with
``torchrig.compat.accelerate_names.TABLE`` (so those tests run without Accelerate installed).

The rule (RULE below, recorded in the output): a name of module M is listed when ``dir(M)`` shows it
after ``import M``, or when M's source binds it at module level inside an ``if``/``try`` branch (names
that exist only where an optional library is installed, e.g. the Megatron-LM names of
``accelerate.utils``), unless it is

1. private: it starts with an underscore;
2. a module (``import os``, ``import torch.nn as nn``, ``from .utils import rich``);
3. standard-library plumbing: a class, function or typing construct the module imported from the
   standard library under its own name (``Any``, ``Optional``, ``contextmanager``, ``partial``,
   ``Path``, ``from __future__ import annotations``), or an instance of a standard-library class other
   than plain data (the module's ``logger``, a ``logging.Logger`` or ``LoggerAdapter``);
4. a leaked loop variable: bound only as the target of a module-level ``for`` loop.

Everything else counts, wherever it was defined: Accelerate's own objects, names it re-exports from its
other modules (``accelerate.state.DistributedType``), from torch (``accelerate.data_loader.DataLoader``)
or another library, and its module-level data (``accelerate.checkpointing.MODEL_NAME``). For each name
the output also records where the object was defined (``origins``), so a test can check that a
re-exported name maps onto the same torchrig object as at its home path.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import pathlib
import sys
import types

#: The module paths listed: the two packages and the modules torchrig mirrors.
MODULES = ("accelerate", "accelerate.utils", "accelerate.state", "accelerate.logging", "accelerate.local_sgd",
           "accelerate.launchers", "accelerate.big_modeling", "accelerate.data_loader", "accelerate.optimizer",
           "accelerate.scheduler", "accelerate.tracking", "accelerate.checkpointing")

RULE = ("dir()-public names plus names bound at module level in any if/try branch of the source; excluded: "
        "leading underscore, modules, classes/functions/typing constructs imported from the standard library under "
        "their own name, instances of standard-library classes other than plain data (loggers), and leaked "
        "module-level for-loop variables")

PLAIN_DATA = (str, bytes, int, float, complex, bool, type(None), tuple, list, dict, set, frozenset)


def is_stdlib(module_name: str | None) -> bool:
    return bool(module_name) and module_name.split(".")[0] in sys.stdlib_module_names | {"__future__"}


def is_stdlib_plumbing(name: str, value: object) -> bool:
    """Rule 3: imported from the standard library under its own name, or an instance of a stdlib class."""
    if isinstance(value, type) or callable(value) or type(value).__module__ == "typing":
        own_name = getattr(value, "__name__", None) or getattr(value, "_name", None)
        if is_stdlib(getattr(value, "__module__", None)) and own_name == name:
            return True
    if isinstance(value, type) or callable(value) or isinstance(value, PLAIN_DATA):
        return False
    return any(is_stdlib(cls.__module__) and cls is not object for cls in type(value).__mro__)


def source_bindings(path: pathlib.Path) -> tuple[dict[str, ast.stmt], set[str]]:
    """Names bound at module level inside ``if``/``try`` branches (statement that binds them), and the
    targets of module-level ``for`` loops."""
    branch_bound: dict[str, ast.stmt] = {}
    loop_targets: set[str] = set()

    def bind(node: ast.stmt) -> None:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            branch_bound.setdefault(node.name, node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                branch_bound.setdefault(alias.asname or alias.name.split(".")[0], node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Name):
                        branch_bound.setdefault(leaf.id, node)

    def walk(body: list[ast.stmt], in_branch: bool) -> None:
        for node in body:
            if isinstance(node, ast.If):
                walk(node.body, True)
                walk(node.orelse, True)
            elif isinstance(node, ast.Try):
                walk(node.body, True)
                for handler in node.handlers:
                    walk(handler.body, True)
                walk(node.orelse, True)
                walk(node.finalbody, True)
            elif isinstance(node, ast.For):
                loop_targets.update(leaf.id for leaf in ast.walk(node.target) if isinstance(leaf, ast.Name))
            elif in_branch:
                bind(node)

    walk(ast.parse(path.read_text()).body, False)
    return branch_bound, loop_targets


def branch_only_name_counts(module: types.ModuleType, name: str, node: ast.stmt) -> bool:
    """Whether a name bound only in a branch not taken here counts (rules 2 and 3 from the source)."""
    if isinstance(node, ast.Import):
        return False  # a module
    if isinstance(node, ast.ImportFrom):
        if node.level == 0:
            return not is_stdlib(node.module)
        package = pathlib.Path(module.__file__).parent
        for _ in range(node.level - 1):
            package = package.parent
        imported_from = package.joinpath(*(node.module or "").split("."))
        original = next(alias.name for alias in node.names if (alias.asname or alias.name) == name)
        return not ((imported_from / f"{original}.py").exists() or (imported_from / original / "__init__.py").exists())
    return True


def public_names(module_name: str) -> dict[str, str]:
    """name -> the module that defined the object (``?`` when the name exists only in a branch not taken)."""
    module = importlib.import_module(module_name)
    branch_bound, loop_targets = source_bindings(pathlib.Path(module.__file__))
    names: dict[str, str] = {}
    for name in dir(module):
        value = getattr(module, name)
        if name.startswith("_") or isinstance(value, types.ModuleType) or is_stdlib_plumbing(name, value):
            continue
        if name in loop_targets and name not in branch_bound:
            continue
        defined_in = getattr(value, "__module__", None) if (inspect.isclass(value) or callable(value)) else None
        names[name] = defined_in or module_name
    for name, node in branch_bound.items():
        if name not in names and not name.startswith("_") and not hasattr(module, name) \
                and branch_only_name_counts(module, name, node):
            names[name] = "?"
    return dict(sorted(names.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="", help="where Accelerate came from (default: its version, released)")
    parser.add_argument("--output", type=pathlib.Path, default=pathlib.Path(__file__).with_name("accelerate_names.json"))
    args = parser.parse_args()
    accelerate = importlib.import_module("accelerate")
    source = args.source or f"accelerate {accelerate.__version__} (the released wheel)"
    origins = {module: public_names(module) for module in MODULES}
    output = args.output
    output.write_text(json.dumps({"source": source, "rule": RULE,
                                  "names": {module: list(names) for module, names in origins.items()},
                                  "origins": origins}, indent=1) + "\n")
    print(f"{sum(map(len, origins.values()))} names in {len(origins)} modules -> {output}")


if __name__ == "__main__":
    main()
