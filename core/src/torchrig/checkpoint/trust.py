"""Loading never runs code from a checkpoint unless asked to, and saving writes only what loads.

Every pickle-based file the core reads goes through :func:`load_pickled`: ``torch.load`` with
``weights_only=True`` (PyTorch's restricted unpickler: tensors, containers, numbers, strings;
no imports, no calls). A file that needs more is refused with a message naming the file and the
type it holds; ``allow_pickle=True`` on ``load_state`` reads it with full unpickling, which can
execute arbitrary code — use it only for checkpoints you wrote or trust.

The other half: :func:`check_loadable` runs before anything is written with ``torch.save`` and
refuses state that the restricted unpickler could not read back (a numpy array in an optimizer
state, a ``Fraction`` in a scheduler), naming the object and where in its state the value sits.
Containers and tensors are walked; every other value is round-tripped alone through
``torch.save``/``torch.load(weights_only=True)`` in memory, so the check follows exactly what
PyTorch's loader accepts, and costs nothing for tensor data.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from typing import Any

from torchrig.checkpoint.files import CheckpointError

#: What ``load_state`` says about the opt-in (also in docs/checkpoints.md).
PICKLE_OPT_IN = ("pass load_state(..., allow_pickle=True) to unpickle it fully — only if you trust whoever wrote "
                 "this checkpoint: unpickling can run any code")
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _key(key: Any) -> str:
    return f"[{key!r}]"


def _first_unloadable(value: Any, where: str, seen: set[int]) -> tuple[str, Any] | None:
    import torch

    if isinstance(value, torch.Tensor) or type(value) in _PLAIN:  # exact: numpy.float64 subclasses float
        return None
    if id(value) in seen:
        return None
    if type(value) in (dict, list, tuple, set, frozenset) or (
            isinstance(value, Mapping) and type(value).__module__ == "collections"):
        seen.add(id(value))
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        for key, item in items:
            if isinstance(value, Mapping):
                found = _first_unloadable(key, f"{where} key {key!r}", seen) if type(key) not in _PLAIN else None
                if found:
                    return found
            found = _first_unloadable(item, f"{where}{_key(key)}", seen)
            if found:
                return found
        return None
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception:
        return where, value
    return None


def check_loadable(state: Any, what: str) -> None:
    """Refuse ``state`` (of ``what``, e.g. ``optimizer 0``) if ``torch.load(weights_only=True)``
    could not read it back."""
    found = _first_unloadable(state, "", set())
    if found is None:
        return
    where, value = found
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    raise CheckpointError(f"{what}: {where or 'its state'} holds a {kind}, which a checkpoint could not load back "
                          "(load_state reads with torch.load(weights_only=True), which refuses it); store a tensor or "
                          "a plain Python value there instead (e.g. torch.as_tensor(x), float(x), str(x))")


def load_pickled(path: str, what: str, *, allow_pickle: bool = False, map_location: Any = "cpu") -> Any:
    """``torch.load`` a pickle-based file of a checkpoint, safely unless ``allow_pickle``."""
    import torch

    if allow_pickle:
        return torch.load(path, map_location=map_location, weights_only=False)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = str(exc).strip().splitlines()
        fallback = detail[0] if detail else type(exc).__name__
        reason = next((line.strip() for line in detail if "GLOBAL" in line or "Unsupported" in line), fallback)
        raise CheckpointError(f"{path} ({what}) holds objects that the safe loader refuses ({reason}); "
                              f"{PICKLE_OPT_IN}") from exc


__all__ = ["PICKLE_OPT_IN", "check_loadable", "load_pickled"]
