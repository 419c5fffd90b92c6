"""What the Accelerate name table can say about a name (torch-free, no torchrig imports)."""

from __future__ import annotations

import attrs


class RefusedNameError(ImportError):
    """An Accelerate name torchrig deliberately does not provide (the message says why and what to
    use), or one only a plugin provides and none installed does. An ``ImportError`` so that
    ``from torchrig.utils import X`` shows this message rather than Python's generic one."""


@attrs.frozen
class Refused:
    """A name torchrig does not provide: ``reason`` (why) and ``instead`` (what to use)."""

    reason: str
    instead: str


@attrs.frozen
class FromPlugin:
    """A name an installed plugin provides through its manifest's ``exports``."""

    #: The export's name (usually the Accelerate name itself).
    export: str
    #: What provides it, for the error when nothing installed does (a pip requirement or a sentence).
    provided_by: str
    #: torchrig's own object (``"module:attribute"``) used when no installed plugin exports it.
    fallback: str | None = None


#: A table entry: torchrig's own object as ``"module:attribute"``, a plugin export, or a refusal.
Target = str | FromPlugin | Refused

__all__ = ["FromPlugin", "Refused", "RefusedNameError", "Target"]
