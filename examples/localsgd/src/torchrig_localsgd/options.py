"""``localsgd_config``: the strategy's own configuration section. Torch-free (the manifest and the
CLI import it).

It is set like any torchrig section: a config file's ``localsgd_config:`` mapping,
``TORCHRIG_LOCALSGD_CONFIG__SYNC_EVERY=8``, the ``--localsgd_sync_every`` flag of ``torchrig
launch``, or an instance in ``Accelerator(kwargs_handlers=[LocalSGDKwargs(sync_every=8)])``.
"""

from __future__ import annotations

import attrs
from torchrig.plugin import at_least, option


@attrs.frozen(kw_only=True)
class LocalSGDKwargs:
    """How often the ranks' parameters are averaged."""

    sync_every: int = option(4, help="average the parameters across ranks every K optimizer steps (1: every step, "
                                     "which for plain SGD equals averaging gradients)", validator=at_least(1))
    average_buffers: bool = option(True, help="average floating-point buffers (BatchNorm running statistics) "
                                              "together with the parameters")


__all__ = ["LocalSGDKwargs"]
