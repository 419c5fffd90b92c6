"""Plugin hosts for tests: the installed plugins plus fake distributions."""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Iterable, Mapping

from torchrig.defaults import training as training_defaults
from torchrig.host.discovery import installed_distributions
from torchrig.host.plugin_host import PluginHost
from torchrig.launch import defaults as launch_defaults


def make_host(
    *fake_distributions: md.Distribution,
    include_installed: bool = True,
    disabled: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
) -> PluginHost:
    """A fresh :class:`~torchrig.host.plugin_host.PluginHost` over the installed distributions
    (unless ``include_installed=False``) plus ``fake_distributions``. ``environ`` defaults to an
    empty mapping so the caller's ``TORCHRIG_DISABLE_PLUGINS`` does not leak into tests. Every
    family of the core's defaults is registered, as in a training run and the launcher."""
    dists = [*installed_distributions(), *fake_distributions] if include_installed else list(fake_distributions)
    host = PluginHost(dists, disabled=disabled, environ={} if environ is None else environ)
    training_defaults.register(host)
    launch_defaults.register(host)
    return host


__all__ = ["make_host"]
