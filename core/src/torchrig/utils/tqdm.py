"""A tqdm progress bar shown on the main process only (Accelerate's ``utils.tqdm``)."""

from __future__ import annotations

from typing import Any

from torchrig.compat.resolve import module_attributes


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """``tqdm.auto.tqdm(*args, **kwargs)``, disabled on every process but the local main one
    unless ``main_process_only=False``. Needs ``tqdm`` (``pip install tqdm``)."""
    # Imported here, not at the top: torchrig.utils binds this function eagerly and must stay
    # torch-free to import (torchrig.distributed.process needs torch).
    from torchrig.distributed.process import PartialState

    try:
        from tqdm.auto import tqdm as auto_tqdm
    except ImportError as exc:
        raise ImportError("torchrig.utils.tqdm needs the tqdm package: pip install tqdm") from exc
    if args and isinstance(args[0], bool):
        raise ValueError("tqdm(True/False, ...): pass main_process_only= as a keyword; the first positional "
                         "argument is the iterable")
    if main_process_only and not PartialState().is_local_main_process:
        kwargs["disable"] = True
    return auto_tqdm(*args, **kwargs)


__all__ = ["tqdm"]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
