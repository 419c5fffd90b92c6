"""Accelerate's ``accelerate.utils``, under torchrig: every name it offers (configuration classes,
kwargs handlers, enums, collectives, ``is_*_available`` checks, memory, random and modeling helpers).

Every name resolves from the declared table :mod:`torchrig.compat.accelerate_names` — torchrig's
own object (mostly from the submodules beside this file, which mirror Accelerate's), a plugin's
export, or a refusal that says why and what to use (docs/accelerate.md). Names resolve on first
use, so importing this package stays cheap.
"""

from torchrig.compat.resolve import module_attributes, provided_names

__getattr__, __dir__ = module_attributes(__name__, globals())
__all__ = provided_names("accelerate.utils")

# ``tqdm`` is both a submodule here and the function it defines (as in Accelerate). Bound eagerly,
# so that the package attribute is the function whichever of the two is imported first (the import
# system sets a package's attribute to a submodule only when it first loads it).
from torchrig.utils.tqdm import tqdm  # noqa: E402
