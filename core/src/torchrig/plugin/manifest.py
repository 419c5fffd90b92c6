"""The torch-free half of a plugin: its manifest.

A plugin declares two entry points under the same name: the runtime object (group
``torchrig.<kind>s``), imported only when the plugin is selected, and a manifest class
(group ``torchrig.<kind>s.manifests``), loaded for every installed plugin so that
``torchrig launch --help``, config validation and ``torchrig plugins`` know every plugin
without importing torch or the plugin's dependencies.

A manifest subclasses :class:`PluginManifest` and sets class attributes; it is instantiated
once per plugin manager and registered as a pluggy plugin, so it can also implement the
configuration hooks (``torchrig_validate_config``) with ``@hookimpl``.

Example::

    class DeepSpeedManifest(PluginManifest):
        api_version = HOOK_API_VERSION
        summary = "DeepSpeed ZeRO stages 0-3"
        install_hint = "torchrig[deepspeed]"
        requires = ("deepspeed",)
        config_section = ConfigSection("deepspeed_config", DeepSpeedOptions)
        cli_flags = (CliFlag("--zero_stage", "deepspeed_config.zero_stage", type="int"),)

        @hookimpl
        def torchrig_validate_config(self, config):
            ...
"""

from __future__ import annotations

from typing import ClassVar

from torchrig.plugin.markers import hookimpl
from torchrig.plugin.types import CliFlag, ConfigSection


class PluginManifest:
    """Base class of plugin manifests. Must stay importable without torch."""

    #: Hook-API version this plugin was written for (:data:`torchrig.plugin.hookspecs.HOOK_API_VERSION`).
    api_version: ClassVar[int | None] = None
    #: One line for ``torchrig plugins``.
    summary: ClassVar[str] = ""
    #: Top-level modules the runtime entry imports; a missing one makes the plugin
    #: *unavailable* (checked with ``importlib.util.find_spec``, without importing).
    requires: ClassVar[tuple[str, ...]] = ()
    #: What to ``pip install`` to get the runtime's dependencies (e.g. ``"torchrig[deepspeed]"``).
    #: Defaults to the plugin's own distribution.
    install_hint: ClassVar[str | None] = None
    #: Auto-detected kinds (device, cluster): higher priority is asked first.
    priority: ClassVar[int] = 0
    #: The plugin's own configuration section, if any.
    config_section: ClassVar[ConfigSection | None] = None
    #: Flags the plugin adds to ``torchrig launch``.
    cli_flags: ClassVar[tuple[CliFlag, ...]] = ()
    #: Other values that select this plugin in configuration, compared case-insensitively: a
    #: strategy lists the Accelerate ``distributed_type`` values it serves (``"MULTI_GPU"``).
    aliases: ClassVar[tuple[str, ...]] = ()
    #: Strategy: the ``parallelism_config`` axes it can build (``"dp_replicate"``, ``"dp_shard"``, ``"tp"``,
    #: ``"cp"``, ``"pp"``); a run asking for any other axis > 1 is refused before launch, naming the
    #: strategies that declare it (docs/parallelism.md).
    parallelism_axes: ClassVar[tuple[str, ...]] = ()
    #: Strategy: the style names a ``parallelism_config.tp_plan`` may use under it (its own vocabulary and
    #: any it translates, e.g. transformers'); a plan naming another is refused before launch and again in
    #: each worker, naming the entry and listing these. The core knows no style names of its own.
    tp_styles: ClassVar[tuple[str, ...]] = ()
    #: A strategy that is the default when a job has several processes and names no strategy.
    default_for_distributed: ClassVar[bool] = False
    #: Public names this plugin provides as ``torchrig.<name>`` (``{"DeepSpeedPlugin":
    #: "torchrig_deepspeed.options:DeepSpeedPlugin"}``); resolved lazily, torch-free. Accelerate's
    #: names that a plugin provides (see :mod:`torchrig.compat.accelerate_names`) resolve from here.
    exports: ClassVar[dict[str, str]] = {}

    # -- what the plugin answers to in Accelerate's vocabulary (torchrig.compat.enums) ----------------
    #: Strategy: the ``DistributedType`` value it answers to (``accelerator.distributed_type``):
    #: ``"NO"``, ``"FSDP"``, ``"DEEPSPEED"``..., or ``"MULTI_{device}"`` for data parallelism over
    #: the selected device, whose :attr:`distributed_device` fills ``{device}`` (cuda: ``GPU``, so
    #: ``MULTI_GPU``). ``None``: the strategy's own name, a pseudo-member equal to no Accelerate one.
    distributed_type: ClassVar[str | None] = None
    #: Device: its name in Accelerate's multi-process values (``"GPU"``, ``"CPU"``); ``None``: the
    #: device plugin's name in upper case.
    distributed_device: ClassVar[str | None] = None
    #: Precision: the ``PrecisionType`` value it answers to (``accelerator.mixed_precision``);
    #: ``None``: the plugin's own name.
    precision_type: ClassVar[str | None] = None
    #: Strategy: the ``AcceleratorState`` attribute under which Accelerate exposes this strategy's
    #: options (``"deepspeed_plugin"``): the run's section object when selected, ``None`` otherwise.
    state_attribute: ClassVar[str | None] = None

    def unavailable_reason(self) -> str | None:
        """Why the plugin cannot be used on this machine although it is installed (its device is
        absent: ``"no CUDA device visible"``), or None. ``torchrig plugins`` asks every installed
        plugin, so this must be cheap and torch-free (read files, variables, metadata)."""
        return None

    @hookimpl
    def torchrig_config_sections(self) -> list[ConfigSection]:
        return [self.config_section] if self.config_section is not None else []

    @hookimpl
    def torchrig_cli_flags(self) -> list[CliFlag]:
        return list(self.cli_flags)


__all__ = ["PluginManifest"]
