"""Import a script (a generator in docs/, a benchmark) as a module without putting its folder on ``sys.path``.

Tests that check a script's constants or functions used to insert the script's folder into ``sys.path`` at import
time, which leaks every sibling file into every later import of the test run; loading by file path leaks nothing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: str | Path, name: str | None = None) -> ModuleType:
    """The module ``path`` defines, executed once and registered in ``sys.modules`` as ``name`` (the file's stem by
    default: dataclasses and pickle look a module up there). A second call returns the registered module."""
    path = Path(path)
    name = name or path.stem
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the script {path} as a module: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
