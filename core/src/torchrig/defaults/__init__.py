"""The core's default hook implementations, one module per hook family: one ``trylast``
answer for every firstresult hook, so "nobody answered" cannot happen.

Each family is registered by whoever builds a host that calls its hooks, so no lower layer
imports a higher one:

* :mod:`~torchrig.defaults.configuration` (``"core:defaults"``, torch-free): every
  :class:`~torchrig.host.plugin_host.PluginHost` — configuration, cluster, memory estimate, worker
  environment;
* :mod:`~torchrig.defaults.process` (``"core:process-defaults"``): :func:`torchrig.host.runtime.start_run`
  (``PartialState``, the Accelerator) — device, process group, collectives, capabilities;
* :mod:`~torchrig.defaults.training` (``"core:training-defaults"``): the Accelerator — prepare,
  strategy state, full state dict;
* :mod:`torchrig.launch.defaults` (``"core:launch-defaults"``): the launcher — ``torchrig_launch``.
"""
