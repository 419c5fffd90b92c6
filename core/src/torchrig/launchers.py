"""Accelerate's ``accelerate.launchers``, under torchrig: run a function on several processes from Python or a notebook.

Every name resolves from the declared table :mod:`torchrig.compat.accelerate_names` — torchrig's
own object, a plugin's export, or a refusal that says why and what to use (docs/accelerate.md).
"""

from torchrig.compat.resolve import module_attributes, provided_names

__getattr__, __dir__ = module_attributes(__name__, globals())
__all__ = provided_names("accelerate.launchers")
