"""Accelerate's ``accelerate.utils.dataclasses``, under torchrig: the configuration classes, kwargs handlers and enums.

Every name resolves from the declared table :mod:`torchrig.compat.accelerate_names` — torchrig's
own object, a plugin's export, or a refusal that says why and what to use (docs/accelerate.md).
"""

from torchrig.compat.resolve import module_attributes, provided_names

__getattr__, __dir__ = module_attributes(__name__, globals())
__all__ = provided_names("accelerate.utils.dataclasses")
