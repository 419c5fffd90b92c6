"""Version comparisons by library name or version (Accelerate's ``compare_versions``)."""

from __future__ import annotations

import importlib.metadata
import operator
from collections.abc import Callable
from typing import Any

from packaging.version import Version, parse

from torchrig.compat.resolve import module_attributes

_OPERATIONS: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt, ">=": operator.ge, "==": operator.eq, "!=": operator.ne, "<=": operator.le, "<": operator.lt,
}


def compare_versions(library_or_version: str | Version, operation: str, requirement_version: str) -> bool:
    """``library_or_version <operation> requirement_version``; a string is an installed
    distribution's name (``compare_versions("torch", ">=", "2.4")``)."""
    if operation not in _OPERATIONS:
        raise ValueError(f"operation must be one of {', '.join(_OPERATIONS)}, not {operation!r}")
    if isinstance(library_or_version, str):
        library_or_version = parse(importlib.metadata.version(library_or_version))
    return _OPERATIONS[operation](library_or_version, parse(requirement_version))


def is_torch_version(operation: str, version: str) -> bool:
    """Whether the installed torch satisfies ``<operation> version``."""
    return compare_versions("torch", operation, version)


__all__ = ["compare_versions", "is_torch_version"]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
