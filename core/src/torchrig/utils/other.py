"""Accelerate's ``accelerate.utils.other``, under torchrig: model unwrapping, compilation, save/load and small helpers.

Every name resolves from the declared table :mod:`torchrig.compat.accelerate_names` — torchrig's
own object, a plugin's export, or a refusal that says why and what to use (docs/accelerate.md).
"""

from torchrig.compat.resolve import module_attributes, provided_names

__getattr__, __dir__ = module_attributes(__name__, globals())
__all__ = provided_names("accelerate.utils.other")
