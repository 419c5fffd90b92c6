"""Repository-wide test policy: the fast tier never starts a process.

``-m "not multiprocess and not slow and not packaging and not scale"`` is the tier a developer runs after every
edit (README, "Run one test / one tier"); it stays fast only if every test that starts a process
says so. A test without the ``multiprocess`` marker (given by hand, or by asking for the
``gloo_pool``/``process_guard`` fixtures) that starts one — ``subprocess``, ``os.fork``,
``multiprocessing`` — fails, naming what it started and how to mark it. Set
``TESTS_REPORT_SPAWNS=path`` to list such tests in a file instead of failing them.

One exemption stays in the tier: ``lint`` tests (tests/repository/test_lint.py), whose ruff is a binary
started once for the whole repository — a fraction of a second, no interpreter, no torch.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing.process
import os
import pathlib
import platform
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from _pytest.mark.expression import Expression

#: Markers whose tests may start processes: the three the fast tier deselects, and ``lint``.
_EXEMPT_MARKERS = ("multiprocess", "packaging", "slow", "lint")

# Test modules as pytest rewrites their asserts, and the repository's own modules, are cached in __pycache__
# even where the environment sets PYTHONDONTWRITEBYTECODE (this project's CI image does): each pytest worker
# otherwise compiles ~300 modules again at every run (~6 of the fast tier's ~14 s of collection on 2 cores), and
# every rank a test launches compiles torchrig again. Where the tree is read-only, Python skips the write.
sys.dont_write_bytecode = False

# The tests of Ctrl-C (the notebook launcher, `torchrig config`) need SIGINT delivered to the processes they start,
# as in a terminal. A suite started with it ignored — a non-interactive shell ignores it for its background jobs
# (`bash .ci/run &`): six such tests failed so — would pass that on; Python's own handler here makes the children
# start with the default again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# The standard library runs `uname -p` once per process, on first use, and caches the answer
# (libraries such as MLflow ask): asked here, before any test, it is nobody's process.
platform.processor()


#: ``pytestmark = pytest.mark.NAME`` (or a list of such marks) at the top level of a test module.
_MODULE_MARKS = re.compile(r"^pytestmark\s*=\s*\[?([^\n\]]*)", re.MULTILINE)


def pytest_ignore_collect(collection_path: pathlib.Path, config: pytest.Config) -> bool | None:
    """A test module marked as a whole (``pytestmark = pytest.mark.multiprocess``) that the ``-m``
    expression deselects is not imported at all: read, not imported, so the fast tier does not pay
    for what its multi-process modules import (DeepSpeed, PEFT, Ray: seconds on each pytest worker)
    only to deselect every test in them."""
    expression = config.getoption("markexpr", "")
    if not expression or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    try:
        found = _MODULE_MARKS.search(collection_path.read_text(encoding="utf-8"))
    except OSError:
        return None
    if found is None:
        return None
    marks = set(re.findall(r"pytest\.mark\.(\w+)", found.group(1)))
    if not marks:
        return None
    # a test of the module may carry more marks than the module's: skipped only when no test could match
    others = sorted(set(re.findall(r"[A-Za-z_]\w*", expression)) - {"and", "or", "not"} - marks)
    try:
        compiled = Expression.compile(expression)
        for extra in itertools.chain.from_iterable(itertools.combinations(others, n) for n in range(len(others) + 1)):
            present = marks | set(extra)
            if compiled.evaluate(lambda name, **_: name in present):
                return None
    except Exception:  # noqa: BLE001 — an expression pytest will report itself
        return None
    return True


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection built (torch, transformers, every test module: millions of objects
    that live until exit) out of the garbage collector's sight. Every full collection after it —
    Python's own, ``rank_environment``'s and ``free_memory``'s before each Accelerator, pytest's at
    exit — then walks only what the tests made: ~0.4 s each on 2 cores before, milliseconds after.
    Objects the tests create are collected exactly as before."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    if any(request.node.get_closest_marker(name) for name in _EXEMPT_MARKERS):
        yield
        return
    started: list[str] = []
    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    fork = os.fork
    start = multiprocessing.process.BaseProcess.start

    def recording_execute_child(self: Any, args: Any, *rest: Any, **kwargs: Any) -> Any:
        started.append(f"subprocess {args if isinstance(args, str) else ' '.join(map(str, args))[:120]}")
        return execute_child(self, args, *rest, **kwargs)

    def recording_fork() -> int:
        started.append("os.fork()")
        return fork()

    def recording_start(self: Any) -> None:
        started.append(f"multiprocessing {type(self).__name__}")
        start(self)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", recording_execute_child)
    monkeypatch.setattr(os, "fork", recording_fork)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", recording_start)
    yield
    if not started:
        return
    report = os.environ.get("TESTS_REPORT_SPAWNS")
    if report:
        with open(report, "a") as handle:
            handle.write(f"{request.node.nodeid}\t{started[0]!r}\n")
        return
    pytest.fail(f"{request.node.nodeid} started a process ({started[0]}) but is not marked multiprocess: add "
                "@pytest.mark.multiprocess (or `pytestmark = pytest.mark.multiprocess` for the module) so the fast "
                "tier stays fast", pytrace=False)
