"""Lint that runs in the fast tier: ruff over the whole repository with the rules pinned in
pyproject.toml (``[tool.ruff.lint]``), import-linter's contracts (``[tool.importlinter]``) and the
no-cycle check, so a developer sees an unused import or a layer broken upward after every edit,
not only in CI.

Import-linter and grimp run in this process (their Python APIs). Ruff is a binary, so its test
starts one short process: it carries the ``lint`` marker, which the fast tier's ``-m`` expression
selects and the root conftest.py exempts from the fast tier's no-process rule.
"""

from __future__ import annotations

import logging
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.lint
def test_ruff_passes_on_the_repository():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(REPO)], capture_output=True,
                            text=True, timeout=300, check=False, cwd=REPO)
    assert result.returncode == 0, f"ruff check failed:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"


def test_import_boundaries_hold(capsys: pytest.CaptureFixture[str]):
    # The use case, not importlinter.cli.lint_imports: the CLI function also rewrites the logging
    # configuration (dictConfig disables every existing logger, torchrig's too) and sys.path.
    try:
        from importlinter import api  # noqa: F401  (configures import-linter's readers and graph builder)
        from importlinter.application import use_cases
    except ImportError:
        pytest.fail("import-linter is not installed (pip install -r requirements-dev.txt)")
    torchrig_logger = logging.getLogger("torchrig")
    passed = use_cases.lint_imports(config_filename=str(REPO / "pyproject.toml"), cache_dir=None, no_logo=True)
    report = capsys.readouterr().out
    assert passed, report
    assert re.search(r"Contracts: \d+ kept, 0 broken\.", report), report
    assert not torchrig_logger.disabled, "linting must leave the test process's logging as it was"


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


class _Markers(dict):
    """A marker expression's names: True for the markers a test carries, False for any other."""

    def __missing__(self, name: str) -> bool:
        return False


def test_the_readmes_fast_tier_selects_every_lint_test():
    readme = (REPO / "README.md").read_text()
    fast_tier = re.search(r'python -m pytest -m "([^"]+)"[^#\n]*# fast tier', readme)
    assert fast_tier, "README.md's 'Run one test / one tier' block lost its fast-tier command"
    lint_tests = [value for name, value in globals().items() if name.startswith("test_") and callable(value)]
    for test in lint_tests:
        markers = _Markers({mark.name: True for mark in getattr(test, "pytestmark", [])})
        assert eval(fast_tier.group(1), {"__builtins__": {}}, markers), \
            f"{test.__name__} (markers {sorted(markers)}) is left out of the fast tier ({fast_tier.group(1)!r})"
