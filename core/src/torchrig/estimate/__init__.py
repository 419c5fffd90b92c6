"""Estimates made before a run: per-rank memory as data (:mod:`.memory`) and the model side of it, built on
the meta device (:mod:`.memory_model`). Strategies contribute their part through ``torchrig_estimate_memory``.
"""
