"""What keeps the fast tier fast (root conftest.py), checked where it runs."""

from __future__ import annotations

import gc


def test_what_collection_built_is_frozen_out_of_the_garbage_collectors_sight():
    # In the whole tier torch, the plugins and every test module are frozen: a full collection that
    # walked them took ~0.4 s on 2 cores, paid before every Accelerator a contract test builds.
    # Run alone, pytest's own objects are (~45,000).
    assert gc.get_freeze_count() > 10_000, gc.get_freeze_count()
