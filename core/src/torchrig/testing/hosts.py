"""Plugin hosts for tests (the installed plugins plus fake distributions) and the resolved
configurations runs built by hand need."""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Iterable, Mapping
from typing import Any

from torchrig.config.resolve import resolve_config
from torchrig.config.resolved import ResolvedConfig
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


def resolved_config(arguments: Mapping[str, Any] | None = None, *, host: PluginHost | None = None) -> ResolvedConfig:
    """The configuration a run built by hand (``RunContext(config=...)``, ``start_run``) needs:
    ``arguments`` as ``Accelerator(...)`` takes them (top-level keys, a section's options object or
    mapping) or as dotted keys (``"dataloader_config.split_batches": True``), resolved over
    ``host``'s plugins (default: a fresh :func:`make_host`) with every check of a real run — and
    nothing read from the machine: no default file, variable or flag."""
    nested: dict[str, Any] = {}
    for key, value in (arguments or {}).items():
        section, _, field = key.partition(".")
        if field:
            nested.setdefault(section, {})[field] = value
        else:
            nested[key] = value
    return resolve_config(make_host() if host is None else host, arguments=nested, environ={}, flags={},
                          default_file=False, warn=False)


__all__ = ["make_host", "resolved_config"]
