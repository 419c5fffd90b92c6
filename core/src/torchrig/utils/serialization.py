"""``save``/``load`` with Accelerate's names: ``torch.save`` on the main process only, and
``torch.load`` that by default cannot run code from the file."""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from torchrig.checkpoint.export import save_object
from torchrig.distributed.process import PartialState


def save(obj: Any, f: str | os.PathLike[str] | io.IOBase, save_on_each_node: bool = False,
         safe_serialization: bool = False) -> None:
    """Write ``obj`` once per job — on the main process, or on each machine's local main process
    with ``save_on_each_node`` — atomically when ``f`` is a path (``torch.save``, or safetensors
    for a mapping of tensors with ``safe_serialization``; tied tensors are stored once)."""
    state = PartialState()
    if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
        return
    if isinstance(f, (str, os.PathLike)):
        save_object(obj, os.fspath(f), safe_serialization)
    elif safe_serialization:
        from safetensors.torch import save as safetensors_bytes

        f.write(safetensors_bytes({k: v.detach().cpu().contiguous() for k, v in obj.items()},
                                  metadata={"format": "pt"}))
    else:
        torch.save(obj, f)


def _numpy_globals() -> list[Any]:
    """NumPy arrays and dtypes are numbers, not code: safe to rebuild with ``weights_only``."""
    try:
        import numpy
    except ImportError:
        return []
    core = getattr(numpy, "_core", None) or numpy.core  # numpy 2 renamed numpy.core
    found = [numpy.ndarray, numpy.dtype, core.multiarray._reconstruct]
    found.extend(getattr(numpy.dtypes, name) for name in dir(numpy.dtypes) if name.endswith("DType"))
    return found


def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True`` unless you pass ``weights_only=False`` (which runs
    any code the file carries: only for files you trust); NumPy arrays load either way."""
    kwargs.setdefault("weights_only", True)
    if not kwargs["weights_only"]:
        return torch.load(f, map_location=map_location, **kwargs)
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(f, map_location=map_location, **kwargs)


__all__ = ["load", "save"]
