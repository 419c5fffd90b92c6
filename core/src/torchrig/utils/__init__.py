"""Accelerate's ``accelerate.utils``, under torchrig: every name it offers (configuration classes,
kwargs handlers, enums, collectives, ``is_*_available`` checks, memory, random and modeling helpers).

Every name resolves from the declared table :mod:`torchrig.compat.accelerate_names` — torchrig's
own object (mostly from the submodules beside this file, which mirror Accelerate's), a plugin's
export, or a refusal that says why and what to use (docs/accelerate.md). Names resolve on first
use, so importing this package stays cheap.
"""

from torchrig.compat.resolve import module_attributes, provided_names

__getattr__, __dir__ = module_attributes(__name__, globals())
__all__ = provided_names("accelerate.utils")  # noqa: PLE0605 -- the table is the one list of names
