"""Out-of-memory helpers: retry a function with a smaller batch size, release memory."""

from __future__ import annotations

import functools
import gc
import inspect
from collections.abc import Callable
from typing import Any

from torchrig.compat.resolve import module_attributes

_OOM_MESSAGES = (
    "CUDA out of memory.",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "CUDA error: out of memory",
    "MPS backend out of memory",
)


def should_reduce_batch_size(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error that a smaller batch could avoid."""
    import torch

    if isinstance(exception, torch.cuda.OutOfMemoryError):
        return True
    if isinstance(exception, RuntimeError) and len(exception.args) == 1:
        return any(message in str(exception.args[0]) for message in _OOM_MESSAGES)
    return False


def release_memory(*objects: Any) -> list[None]:
    """Drop references, collect garbage and empty the device cache; returns Nones to assign."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [None for _ in objects]


def convert_bytes(size: float) -> str:
    """``size`` bytes in the largest unit below 1024 of it (``"1.5 GB"``)."""
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if size < 1024.0:
            return f"{round(size, 2)} {unit}"
        size /= 1024.0
    return f"{round(size, 2)} PB"


def find_executable_batch_size(function: Callable[..., Any] | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[int], int] | None = None) -> Any:
    """Decorator: call ``function(batch_size, ...)``, halving ``batch_size`` after each
    out-of-memory error until it fits (or reaches zero, which raises)."""
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    reduce = reduce_batch_size_fn or (lambda size: size // 2)

    @functools.wraps(function)
    def decorator(*args: Any, **kwargs: Any) -> Any:
        batch_size = starting_batch_size
        params = list(inspect.signature(function).parameters)
        if len(params) < len(args) + 1:
            given = ", ".join(f"{name}={value!r}" for name, value in zip(params[1:], args[1:]))
            raise TypeError(f"batch_size is passed by find_executable_batch_size; call {function.__name__}({given}) "
                            "without it")
        while True:
            if batch_size == 0:
                raise RuntimeError("no executable batch size found: out of memory even at batch size 1")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as exc:
                if not should_reduce_batch_size(exc):
                    raise
                release_memory()
                batch_size = reduce(batch_size)

    return decorator


__all__ = ["convert_bytes", "find_executable_batch_size", "release_memory", "should_reduce_batch_size"]

# Accelerate's other names at this path (refusals, plugin exports): the declared table.
__getattr__, __dir__ = module_attributes(__name__, globals())
