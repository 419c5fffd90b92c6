"""Loss normalised by the valid-token count of the whole optimizer step.

Why: the mean of per-micro-batch means weighs a token in a short (heavily padded) micro-batch more
than one in a long micro-batch, on every data-parallel rank and accumulation micro-step — a silent
bias every framework had (transformers' ``num_items_in_batch``, torchtitan PR #2206). The correct
loss is the sum of the per-token losses over the step's valid tokens (label != ``ignore_index``) on
every rank and micro-step, divided by their number. That number is only known once the last
micro-step of the window has run, so the division happens on the gradients: each micro-step's
backward runs on its loss *sum*, the counts are added up, and after the backward of the micro-step
that syncs, one all-reduce of the count over the ranks the strategy averages gradients over gives
the global count ``N``; the gradients (already averaged over those ``W`` ranks by DDP/FSDP) are
multiplied by ``W / N``, before clipping and the optimizer step. docs/parallelism.md, "Loss normalised
by the token count".
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from torchrig.plugin.types import Capabilities

#: transformers' and torch's label for a position that is not a prediction target (padding, prompt).
IGNORE_INDEX = -100
#: The sub-mesh a strategy with a device mesh averages gradients over (dp_replicate × dp_shard × cp).
GRADIENT_MEAN_SUBMESH = "dp_cp"


def checked_token_count(num_tokens: Any, what: str = "num_tokens") -> int | torch.Tensor:
    """``num_tokens`` as an int (or an integer 0-d/1-element tensor, kept on its device so a GPU count
    costs no synchronisation here); refused when it is not an integer count or is negative. Zero is
    allowed: a rank's micro-batch may be padding only (the step's global count must not be zero)."""
    if isinstance(num_tokens, bool):
        raise TypeError(f"{what} must be the number of valid tokens (an int), got the bool {num_tokens!r}")
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.is_floating_point() or num_tokens.is_complex() or num_tokens.dtype == torch.bool:
            raise TypeError(f"{what} must be an integer count of valid tokens, got a {num_tokens.dtype} tensor; "
                            f"count with (labels != {IGNORE_INDEX}).sum()")
        if num_tokens.numel() != 1:
            raise ValueError(f"{what} must be one count, got a tensor of shape {tuple(num_tokens.shape)}; sum it")
        return num_tokens.reshape(())
    if isinstance(num_tokens, numbers.Integral):
        if num_tokens < 0:
            raise ValueError(f"{what} must be >= 0 (the valid tokens of this micro-batch), got {num_tokens}")
        return int(num_tokens)
    raise TypeError(f"{what} must be the number of valid tokens of this micro-batch (an int or an integer tensor), "
                    f"got {type(num_tokens).__name__} {num_tokens!r}")


def gradient_mean_group(capabilities: Capabilities | None) -> tuple[Any, int]:
    """(process group, size) of the ranks whose gradients the strategy averages: the mesh's ``dp_cp``
    sub-mesh (data-parallel and context-parallel ranks: different tokens, one gradient), else the
    strategy's data-parallel group, else the world (None); size 1 without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    submeshes = getattr(capabilities, "device_submeshes", None) or {}
    if GRADIENT_MEAN_SUBMESH in submeshes:
        mesh = submeshes[GRADIENT_MEAN_SUBMESH]
        return mesh.get_group(), mesh.size()
    group = getattr(capabilities, "data_parallel_group", None)
    return group, dist.get_world_size(group)


def global_token_count(local: int | torch.Tensor, group: Any, size: int, device: Any) -> int:
    """The sum of ``local`` over ``group`` (one all-reduce of one int64), as an int."""
    count = torch.as_tensor(local, dtype=torch.int64, device=device).reshape(())
    if size > 1:
        count = count.clone()
        dist.all_reduce(count, group=group)
    return int(count.item())


def labels_of(batch: Any, shift: bool) -> torch.Tensor:
    """The prediction targets of one micro-batch: a tensor of labels, or a mapping with ``shift_labels``
    (taken as they are) or ``labels`` (``[..., 1:]`` when ``shift``: position 0 predicts nothing)."""
    if isinstance(batch, Mapping):
        if "shift_labels" in batch:
            return batch["shift_labels"]
        if "labels" not in batch:
            raise KeyError(f"token_count: a batch mapping needs 'labels' (or 'shift_labels'); it has {sorted(batch)}")
        labels = batch["labels"]
    else:
        labels = batch
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"token_count: labels must be a tensor (or a batch mapping with 'labels'), "
                        f"got {type(labels).__name__}")
    return labels[..., 1:] if shift else labels


def local_token_count(batches: Any, ignore_index: int = IGNORE_INDEX, shift: bool = True) -> torch.Tensor:
    """Valid labels (``!= ignore_index``) over ``batches``: one micro-batch (a labels tensor or a batch
    mapping) or an iterable of them, as an int64 tensor on the labels' device."""
    many = batches if isinstance(batches, Iterable) and not isinstance(batches, (torch.Tensor, Mapping)) else [batches]
    counts = [labels_of(batch, shift).ne(ignore_index).sum() for batch in many]
    if not counts:
        raise ValueError("token_count: no micro-batch given; pass the labels (or batches) of the optimizer step")
    return torch.stack(counts).sum()


def scale_gradients(parameters: Iterable[Any], factor: float) -> None:
    """Multiply every gradient in ``parameters`` by ``factor`` in place (DTensor gradients included)."""
    with torch.no_grad():
        for param in parameters:
            if param.grad is not None:
                param.grad.mul_(factor)


class TokenCountWindow:
    """The valid tokens the micro-steps of one accumulation window reported to ``backward``, and
    whether an earlier micro-step of the window reported none (mixing both is refused: the window's
    gradients would be half sums, half means). ``backward`` without a count sets ``uncounted`` itself
    (an attribute, not a call: the hot path's budget of calls per step)."""

    def __init__(self) -> None:
        self.count: int | torch.Tensor = 0
        self.counted_steps = 0
        #: An earlier micro-step of this window ran backward without num_tokens.
        self.uncounted = False

    def add(self, num_tokens: int | torch.Tensor) -> None:
        if self.uncounted:
            raise ValueError(self.mixed())
        self.count = self.count + num_tokens
        self.counted_steps += 1

    def reset(self) -> None:
        self.count, self.counted_steps, self.uncounted = 0, 0, False

    def mixed(self) -> str:
        """Why a window that mixes micro-steps with and without num_tokens is refused."""
        return (f"accelerator.backward: an earlier micro-step of this accumulation window ran "
                f"{'with' if self.counted_steps else 'without'} num_tokens; pass num_tokens "
                "on every micro-step of a window or on none (a window's gradients are either token sums or means)")

    def finish(self, parameters: Iterable[Any], capabilities: Capabilities | None, device: Any) -> int:
        """At the micro-step that syncs: the window's global count ``N`` (all-reduced over the ranks the
        strategy averages gradients over, ``W`` of them), and the gradients multiplied by ``W / N``.
        Returns ``N``; refuses a step without a valid token anywhere."""
        group, size = gradient_mean_group(capabilities)
        local, steps = self.count, self.counted_steps
        self.reset()
        total = global_token_count(local, group, size, device)
        if total <= 0:
            raise ValueError(f"accelerator.backward(num_tokens=...): the optimizer step has no valid token on any of "
                             f"its {size} data-parallel rank(s) and {steps} micro-step(s) (the counts add up to "
                             f"{total}); a loss normalised by the token count is undefined — skip the step's batches "
                             "or check that the labels are not all ignore_index")
        scale_gradients(parameters, size / total)
        return total


__all__ = ["GRADIENT_MEAN_SUBMESH", "IGNORE_INDEX", "TokenCountWindow", "checked_token_count",
           "global_token_count", "gradient_mean_group", "labels_of", "local_token_count", "scale_gradients"]
