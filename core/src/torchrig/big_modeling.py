"""Accelerate's ``accelerate.big_modeling``, under torchrig: meta-device initialisation; big-model inference dispatch is refused.

Every name resolves from the declared table :mod:`torchrig.compat.accelerate_names` — torchrig's
own object, a plugin's export, or a refusal that says why and what to use (docs/accelerate.md).
"""

from torchrig.compat.resolve import module_attributes, provided_names

__getattr__, __dir__ = module_attributes(__name__, globals())
__all__ = provided_names("accelerate.big_modeling")
