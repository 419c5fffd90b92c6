"""The ``ft`` plugin's names, shared by its manifest (flags, validation) and its options class;
torch-free and import-free, so neither has to import the other."""

from __future__ import annotations

SECTION = "ft_config"
#: The environment variable that sets ``ft_config.lighthouse`` (torchrig's ``TORCHRIG_<SECTION>__<KEY>``).
LIGHTHOUSE_ENV = "TORCHRIG_FT_CONFIG__LIGHTHOUSE"

__all__ = ["LIGHTHOUSE_ENV", "SECTION"]
