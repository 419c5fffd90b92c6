"""What keeps the fast tier fast (root conftest.py), checked where it runs."""

from __future__ import annotations

import gc


def test_what_collection_built_is_frozen_out_of_the_garbage_collectors_sight():
    # In the whole tier torch, the plugins and every test module are frozen: a full collection that
    # walked them took ~0.4 s on 2 cores, paid before every Accelerator a contract test builds.
    # Run alone, pytest's own objects are (~45,000).
    assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()


def test_bytecode_is_cached_even_where_the_environment_says_not_to():
    # PYTHONDONTWRITEBYTECODE (set in this project's CI image) made every worker compile and assert-rewrite
    # ~300 modules at every run: ~6 s of the fast tier's collection on 2 cores.
    import sys

    assert sys.dont_write_bytecode is False
