"""Where a configuration value came from: the six layers in precedence order (:class:`Layer`),
the exact place in one (:class:`Source`: file:line, variable, flag), a value as a layer gave it
(:class:`Entry`), and an Accelerate key accepted with no effect (:class:`Note`)."""

from __future__ import annotations

import enum
from typing import Any

import attrs


class Layer(enum.IntEnum):
    DEFAULT = 0
    DEFAULT_FILE = 1
    ARGUMENT = 2
    CONFIG_FILE = 3
    ENV = 4
    FLAG = 5

    @property
    def label(self) -> str:
        return {
            Layer.DEFAULT: "default",
            Layer.DEFAULT_FILE: "machine default file",
            Layer.ARGUMENT: "argument",
            Layer.CONFIG_FILE: "config file",
            Layer.ENV: "environment",
            Layer.FLAG: "flag",
        }[self]


@attrs.frozen
class Source:
    """Where a value came from: the layer and the exact place (file:line, variable, flag)."""

    layer: Layer
    detail: str = ""
    #: Said instead of the layer's label (Accelerate's default file read as the machine's default file).
    label: str | None = None

    def __str__(self) -> str:
        return f"{self.label or self.layer.label} {self.detail}".strip()


@attrs.frozen
class Entry:
    """A value as a source gave it, before coercion."""

    value: Any
    source: Source
    #: YAML source text of a plain scalar (``no`` that YAML 1.1 read as False).
    raw: str | None = None


@attrs.frozen
class Note:
    """An Accelerate key accepted with no effect, and why."""

    key: str
    value: Any
    reason: str
    source: Source


__all__ = ["Entry", "Layer", "Note", "Source"]
