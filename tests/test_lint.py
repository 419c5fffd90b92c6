"""Lint that runs: ruff over the whole repository with the rules pinned in pyproject.toml
(``[tool.ruff.lint]``), so CI fails on an unused import or a misordered import block."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_ruff_passes_on_the_repository():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], capture_output=True,
                            text=True, timeout=300, check=False, cwd=REPO)
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"


def test_the_core_has_no_import_cycle():
    # Function-level imports count (grimp sees them): none may close a cycle. Annotations under
    # `if TYPE_CHECKING:` are not imports at run time (the hook specs name every layer's types).
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("torchrig", exclude_type_checking_imports=True, cache_dir=None)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    done: set[str] = set()
    for start in sorted(edges):
        if start in done:
            continue
        path, stack = [start], [iter(edges[start])]
        while stack:
            child = next(stack[-1], None)
            if child is None:
                done.add(path.pop())
                stack.pop()
                continue
            assert child not in path, "import cycle: " + " -> ".join([*path[path.index(child):], child])
            if child not in done:
                path.append(child)
                stack.append(iter(edges[child]))
