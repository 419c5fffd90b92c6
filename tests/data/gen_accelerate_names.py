"""List the public names of Accelerate's modules, from its own source, for the compatibility table.

    python tests/data/gen_accelerate_names.py PATH/TO/accelerate [--source "huggingface/accelerate@<sha>"]

``PATH/TO/accelerate`` is the package directory of an Accelerate source tree or installation (the
folder holding ``__init__.py``, ``state.py``, ``utils/``). Nothing is imported: the files are
parsed. A package ``__init__`` contributes every name it imports from its submodules (inside
``if``/``try`` blocks too, as Accelerate's optional imports are); a plain module contributes its
``__all__`` if it has one, else every public class and function it defines. Writes
``tests/data/accelerate_names.json``, which ``tests/test_accelerate_names.py`` compares with
``torchrig.compat.accelerate_names.TABLE``.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib

PACKAGES = ("accelerate", "accelerate.utils")
MODULES = ("state", "logging", "local_sgd", "launchers", "big_modeling", "data_loader", "optimizer", "scheduler",
           "tracking", "checkpointing")


def imported_names(path: pathlib.Path) -> list[str]:
    names: list[str] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                names.extend(alias.asname or alias.name for alias in node.names if alias.name != "*")
            elif isinstance(node, ast.If):
                walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                walk(node.body)

    walk(ast.parse(path.read_text()).body)
    return [name for name in dict.fromkeys(names) if not name.startswith("_")]


def defined_names(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [element.value for element in node.value.elts]  # type: ignore[attr-defined]
    return [node.name for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", type=pathlib.Path, help="the accelerate package directory")
    parser.add_argument("--source", default="", help="where the tree came from (recorded in the output)")
    args = parser.parse_args()
    names = {"accelerate": imported_names(args.package / "__init__.py"),
             "accelerate.utils": imported_names(args.package / "utils" / "__init__.py")}
    for module in MODULES:
        names[f"accelerate.{module}"] = defined_names(args.package / f"{module}.py")
    output = pathlib.Path(__file__).with_name("accelerate_names.json")
    output.write_text(json.dumps({"source": args.source, "names": names}, indent=1) + "\n")
    print(f"{sum(map(len, names.values()))} names in {len(names)} modules -> {output}")


if __name__ == "__main__":
    main()
