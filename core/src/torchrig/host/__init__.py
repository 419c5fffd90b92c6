"""The plugin host: finding installed plugins (:mod:`.discovery`), selecting and registering them on pluggy
(:mod:`.plugin_host`), assembling a run from them (:mod:`.runtime`) and the per-process run context every
runtime hook receives (:mod:`.run`). Plugin authors reach these through :mod:`torchrig.plugin`.
"""
