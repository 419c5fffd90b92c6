"""Accelerate's module paths under ``torchrig``: every name resolved from one declared table.

A script migrates from Accelerate by renaming ``accelerate`` to ``torchrig`` (the whole word), so
``from accelerate.utils import gather_object`` becomes ``from torchrig.utils import gather_object``.
Each such module (``torchrig``, ``torchrig.utils``, ``torchrig.state``, ``torchrig.launchers``...)
resolves the names it does not define itself through :func:`module_attributes`, from the table in
:mod:`torchrig.compat.accelerate_names`, which says for every public name of Accelerate's modules
one of three things (:mod:`torchrig.compat.targets`):

* ``"module:attribute"`` — torchrig's own object, imported on first use (``import torchrig``
  stays cheap; ``torchrig --help`` never imports torch);
* :class:`FromPlugin` — provided by whichever installed plugin declares it in its manifest's
  ``exports`` (``DeepSpeedPlugin`` by ``torchrig-deepspeed``); the core never names the plugin;
* :class:`Refused` — deliberately not provided: importing it raises :class:`RefusedNameError`
  saying why and what to use instead. Never simply missing.

Modules: :mod:`.targets` (what an entry can say), :mod:`.accelerate_names` (the table, plain
data) and :mod:`.resolve` (turning an entry into an object). Torch-free.
"""
