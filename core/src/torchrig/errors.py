"""Errors torchrig raises about plugins and configuration.

Every message names the thing that is wrong (plugin, distribution, key, file) and says how to
fix it; the CLI prints the message alone and exits with code 2.
"""

from __future__ import annotations


class TorchrigError(Exception):
    """Base class of torchrig's own errors."""


class ConfigError(TorchrigError, ValueError):
    """The configuration is invalid. ``problems`` lists every problem found, not just the first."""

    def __init__(self, problems: list[str] | str, *, header: str = "invalid torchrig configuration"):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            message = f"{header}: {self.problems[0]}"
        else:
            body = "\n".join(f"  - {p}" for p in self.problems)
            message = f"{header} ({len(self.problems)} problems):\n{body}"
        super().__init__(message)


class PlanningUnsupported(TorchrigError):
    """Raised by a strategy's ``torchrig_prepare_model`` in a planned run (``run.planning``) when it
    cannot lay a model out on the meta device (its engine needs real storage); ``torchrig plan``
    then reports the strategy's ``torchrig_estimate_memory`` answer for that run instead, saying so.
    The message says what the strategy could not plan."""


class NoEffectWarning(UserWarning):
    """An option was set that nothing in this run uses (a GradScaler's options without a GradScaler):
    said rather than ignored, since refusing it would break scripts that set it for every precision."""


class PluginError(TorchrigError):
    """A plugin cannot be found, loaded or used."""


class PluginNotFoundError(PluginError, LookupError):
    """No installed plugin of that kind has that name."""


class PluginConflictError(PluginError):
    """Two distributions provide the same (kind, name) and that name was selected."""


class PluginImportError(PluginError, ImportError):
    """A selected plugin (or its manifest) failed to import."""


class PluginAPIVersionError(PluginError):
    """A plugin was written for a hook-API version this torchrig does not support."""


class PluginDisabledError(PluginError):
    """A disabled plugin was selected."""


__all__ = [
    "ConfigError",
    "PlanningUnsupported",
    "PluginAPIVersionError",
    "PluginConflictError",
    "PluginDisabledError",
    "PluginError",
    "PluginImportError",
    "PluginNotFoundError",
    "TorchrigError",
]
