"""Opt-in pytest plugin: fixtures for plugin tests and multi-process tests.

Fixtures:

* ``fake_modules`` — :class:`~torchrig.testing.fakes.FakeModules`, cleaned up after the test;
* ``gloo_pool`` — a session-wide 2-rank :class:`~torchrig.testing.pool.WorkerPool`; at the end
  of the session it is closed and no worker may survive;
* ``gloo_pool4`` — the same with 4 ranks (N-D meshes: FSDP x TP, HSDP, pipelines): one start per
  session instead of one per test module (each start pays ``import torch`` in four processes, ~6-9 s
  on 2 cores). Idle ranks cost memory only. A module that needs fresh interpreters (a
  warnings-once check) keeps its own pool;
* ``process_guard`` — a :class:`~torchrig.testing.processes.ProcessGuard`; the test fails if a
  process it tracked is still alive at teardown.

Tests marked ``gpu`` are skipped cleanly when no CUDA device is present. A test that uses
``gloo_pool`` or ``process_guard`` is marked ``multiprocess`` by the fixture it asks for, so the
fast tier (``-m "not multiprocess and not slow and not packaging and not scale"``) never starts processes
whether or not its author remembered the marker.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from torchrig.testing.fakes import FakeModules


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "multiprocess: starts processes or uses the gloo worker pool")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped cleanly without one")
    config.addinivalue_line("markers", "slow: long-running; deselect with -m 'not slow'")


#: Fixtures that start processes: a test using one belongs to the multiprocess tier.
MULTIPROCESS_FIXTURES = frozenset({"gloo_pool", "gloo_pool4", "process_guard"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if MULTIPROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())) \
                and not item.get_closest_marker("multiprocess"):
            item.add_marker(pytest.mark.multiprocess)
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none available here)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def fake_modules() -> Iterator[FakeModules]:
    modules = FakeModules()
    yield modules
    modules.cleanup()


#: The session pools that exist, so the module boundary below can stop their workers without creating them.
_SESSION_POOLS: dict[int, Any] = {}


@pytest.fixture(scope="session")
def gloo_pool() -> Iterator[Any]:
    """A 2-rank gloo pool shared by the whole session; no worker may outlive it."""
    # Imported when used: this plugin loads at every pytest start (-p), and the pool needs torch.
    from torchrig.testing.pool import checked_pool

    with checked_pool(2) as pool:
        _SESSION_POOLS[2] = pool
        yield pool
        _SESSION_POOLS.pop(2, None)


@pytest.fixture(scope="session")
def gloo_pool4() -> Iterator[Any]:
    """A 4-rank gloo pool shared by the whole session; no worker may outlive it."""
    from torchrig.testing.pool import checked_pool

    with checked_pool(4) as pool:
        _SESSION_POOLS[4] = pool
        yield pool
        _SESSION_POOLS.pop(4, None)


@pytest.fixture(scope="module", autouse=True)
def _session_pools_start_afresh_in_each_module() -> Iterator[None]:
    """After each test module, the session pools' workers leave (the next module's first task starts new
    ones): the process groups a module's meshes left behind would otherwise pile up in long-lived ranks
    (:meth:`~torchrig.testing.pool.WorkerPool.stop`). Within a module, a pool of each size stays up."""
    yield
    for pool in list(_SESSION_POOLS.values()):
        if not pool.closed:
            pool.stop()


@pytest.fixture
def process_guard() -> Iterator[Any]:
    from torchrig.testing.processes import ProcessGuard

    guard = ProcessGuard()
    yield guard
    guard.assert_none_left()
