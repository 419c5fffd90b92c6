"""The :class:`Accelerator` (Hugging Face Accelerate's user-facing object) and its parts, one module per concern.

:mod:`.accelerator` holds the class (construction and ``prepare``); it delegates each concern to a sibling:
:mod:`.step` (``backward``, ``accumulate``, ``no_sync``, clipping), :mod:`.arguments`
(``Accelerator(...)``'s arguments as configuration), :mod:`.checkpoints` (``save_state``/``load_state``),
:mod:`.collectives` (``gather``/``reduce``/padding), :mod:`.tracking` (``init_trackers``/``log`` and the
throughput monitor), :mod:`.preemption`, :mod:`.step_contexts` (``accumulate``/``autocast``),
:mod:`.context_parallel` and :mod:`.profiling`. ``torchrig.accelerator`` is also Accelerate's
``accelerate.accelerator`` path under the rename rule.
"""

from torchrig.accelerator.accelerator import Accelerator

__all__ = ["Accelerator"]
