"""Resolving a name of an Accelerate module path from the declared table (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchrig.compat.accelerate_names import TABLE
from torchrig.compat.targets import FromPlugin, Refused, RefusedNameError, Target
from torchrig.host.discovery import load_reference
from torchrig.host.plugin_host import PluginHost


def plugin_export(name: str) -> Any | None:
    """The object an installed plugin exports as ``name`` (from its torch-free manifest), or None
    when no installed plugin declares it. A plugin that declares it but cannot load it (its library
    is missing or broken) raises :class:`RefusedNameError` naming the plugin and the cause."""
    for info in PluginHost(register_defaults=False).plugins():
        if info.manifest is None or name not in info.manifest.exports:
            continue
        try:
            return load_reference(info.manifest.exports[name])
        except ImportError as exc:
            distribution = (info.record or info.records[0]).distribution
            hint = f"; install it with: pip install '{info.manifest.install_hint}'" if info.manifest.install_hint else ""
            raise RefusedNameError(
                f"{name} comes from the {info.kind.value} plugin {info.name!r} ({distribution}), which is installed "
                f"but cannot load it: {exc}{hint}", name=name) from exc
    return None


def accelerate_path(torchrig_module: str) -> str:
    """``torchrig.utils.operations`` -> ``accelerate.utils.operations``."""
    return "accelerate" + torchrig_module[len("torchrig"):]


def torchrig_path(accelerate_module: str) -> str:
    return "torchrig" + accelerate_module[len("accelerate"):]


def resolve(accelerate_module: str, name: str) -> Any:
    """The torchrig object for ``accelerate_module.name``; :class:`RefusedNameError` for a refused
    name, ``AttributeError`` for a name Accelerate's module does not have either."""
    target = TABLE.get(accelerate_module, {}).get(name)
    where = f"{torchrig_path(accelerate_module)}.{name}"
    if target is None:
        raise AttributeError(f"module {torchrig_path(accelerate_module)!r} has no attribute {name!r}")
    if isinstance(target, str):
        return load_reference(target)
    if isinstance(target, FromPlugin):
        value = plugin_export(target.export)
        if value is not None:
            return value
        if target.fallback is not None:
            return load_reference(target.fallback)
        raise RefusedNameError(f"{where} is provided by a plugin, and no installed plugin exports {target.export!r}; "
                               f"install one: {target.provided_by}", name=name)
    raise RefusedNameError(f"torchrig does not provide {where} (Accelerate's {accelerate_module}.{name}): "
                           f"{target.reason}. Instead: {target.instead}. See docs/accelerate.md.", name=name)


def module_attributes(torchrig_module: str, namespace: dict[str, Any]) -> tuple[Callable[[str], Any],
                                                                                 Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for a module at an Accelerate path: a name it does not define
    itself resolves from the table, and is kept in the module once resolved."""
    accelerate_module = accelerate_path(torchrig_module)

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {torchrig_module!r} has no attribute {name!r}")
        value = resolve(accelerate_module, name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(TABLE.get(accelerate_module, {})))

    return __getattr__, __dir__


def provided_names(accelerate_module: str) -> list[str]:
    """Names of ``accelerate_module`` torchrig implements itself (a thin module's ``__all__``)."""
    return sorted(name for name, target in TABLE.get(accelerate_module, {}).items() if isinstance(target, str))


__all__ = [
    "TABLE",
    "FromPlugin",
    "Refused",
    "RefusedNameError",
    "Target",
    "accelerate_path",
    "module_attributes",
    "plugin_export",
    "provided_names",
    "resolve",
    "torchrig_path",
]
