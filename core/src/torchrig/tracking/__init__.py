"""Experiment tracking: the core's tracking policy applied to every tracker of a run (:mod:`.hub`), each tracker's
queue and worker thread (:mod:`.lane`), the throughput/MFU monitor (:mod:`.throughput`) and Accelerate's
tracker helpers (:mod:`.helpers`). The interface tracker plugins implement is
:class:`torchrig.plugin.tracker.Tracker`.

This package is also Accelerate's ``accelerate.tracking`` path under the rename rule: its names
(``GeneralTracker``, ``on_main_process``...) resolve from the declared table
(:mod:`torchrig.compat.accelerate_names`).
"""

from torchrig.compat.resolve import module_attributes, provided_names

__getattr__, __dir__ = module_attributes(__name__, globals())
__all__ = provided_names("accelerate.tracking")
