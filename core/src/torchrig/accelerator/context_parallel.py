"""Context parallelism in the user's loop: ``with accelerator.maybe_context_parallel(buffers=[ids,
labels], buffer_seq_dims=[1, 1]):`` shards the batch over the mesh's ``cp`` axis and runs every
``scaled_dot_product_attention`` inside as ring attention (torch's ``context_parallel`` API).

Why the checks: torch's context parallel replaces ``torch.nn.functional.scaled_dot_product_attention``
calls with causal or no masking, on its flash/efficient/cuDNN kernels, and nothing else. Any other
attention — an explicit mask, cross-attention, a model's own eager attention, SDPA bound under
another name, the math backend — would attend within this rank's chunk only and train with wrong
gradients, silently (Accelerate 1.15 had to add refusals after such reports). Inside the context
those patterns are refused, the math backend is excluded, and leaving it without one SDPA call
is an error. The kernels exist for CUDA only in torch 2.13 (the CPU attention op has no sharding
rule), so other devices are refused. docs/parallelism.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from torchrig.errors import ConfigError, PlanningUnsupported

KEY = "parallelism_config.cp_size"
COMM_STRATEGIES = ("allgather", "alltoall")


def buffer_problems(cp_size: int, buffers: Sequence[Any], seq_dims: Sequence[int], no_restore: Sequence[Any],
                    load_balance: bool) -> list[str]:
    """What is wrong with the tensors to shard: counts that differ, sequence lengths that differ or
    do not split evenly (head-tail load balancing needs 2 × cp_size chunks), tensors that require
    grad (sharded in place), ``no_restore_buffers`` not among ``buffers``."""
    problems = []
    if len(buffers) != len(seq_dims):
        return [f"buffer_seq_dims: {len(seq_dims)} sequence dimensions for {len(buffers)} buffers; give one per buffer"]
    if not buffers:
        return ["buffers: no tensor to shard; pass the batch tensors with a sequence dimension (input ids, labels, "
                "position ids) and their buffer_seq_dims"]
    lengths = []
    for index, (buffer, dim) in enumerate(zip(buffers, seq_dims, strict=True)):
        if not isinstance(buffer, torch.Tensor):
            problems.append(f"buffers[{index}]: expected a tensor, got {type(buffer).__name__}")
            continue
        if not -buffer.dim() <= dim < buffer.dim():
            problems.append(f"buffer_seq_dims[{index}]={dim}: buffer {index} has {buffer.dim()} dimensions")
            continue
        if buffer.requires_grad:
            problems.append(f"buffers[{index}]: requires grad (a parameter or an activation); context parallel shards "
                            "buffers in place, so pass inputs (ids, labels, positions), not parameters")
        lengths.append(buffer.shape[dim])
    if len(set(lengths)) > 1:
        problems.append(f"buffers: sequence lengths differ ({', '.join(map(str, lengths))}); every buffer must be "
                        "split at the same positions")
    chunks = 2 * cp_size if load_balance else cp_size
    if lengths and lengths[0] % chunks:
        why = " (head-tail load balancing: 2 chunks per rank)" if load_balance else ""
        problems.append(f"buffers: sequence length {lengths[0]} is not a multiple of {chunks}{why}; pad the batch to a "
                        f"multiple of {chunks}" + (" or set parallelism_config.cp_load_balance: false" if load_balance
                                                   else ""))
    for buffer in no_restore:
        if not any(buffer is given for given in buffers):
            problems.append("no_restore_buffers: holds a tensor that is not in buffers")
    return problems


class AttentionGuard:
    """Wraps the context-parallel SDPA: refuses the calls torch's ring attention would get wrong
    and counts the others."""

    def __init__(self, attention: Callable[..., Any], load_balance: bool) -> None:
        self.attention = attention
        self.load_balance = load_balance
        self.calls = 0

    def __call__(self, query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
                 is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Any:
        problems = self.problems(query, key, attn_mask, is_causal, enable_gqa)
        if problems:
            raise ConfigError(problems, header="context parallel cannot shard this attention")
        self.calls += 1
        return self.attention(query, key, value, dropout_p=dropout_p, is_causal=is_causal, scale=scale)

    def problems(self, query: Any, key: Any, attn_mask: Any, is_causal: bool, enable_gqa: bool) -> list[str]:
        found = []
        if attn_mask is not None:
            found.append("attn_mask: an explicit attention mask (padding, document or sliding-window masks) is not "
                         "sharded with the sequence; only is_causal=True or no mask. Pack sequences without padding "
                         "(or drop the all-ones mask) under context parallel")
        if query.dim() != 4:
            found.append(f"query has {query.dim()} dimensions; ring attention needs (batch, heads, sequence, head_dim)")
        elif query.shape[-2] != key.shape[-2]:
            found.append(f"query length {query.shape[-2]} != key length {key.shape[-2]} (cross-attention or a KV "
                         "cache): only self-attention over the sharded sequence is supported")
        if enable_gqa:
            found.append("enable_gqa=True: grouped-query attention inside SDPA is not supported by the ring kernels; "
                         "repeat the key/value heads (repeat_interleave) before the call")
        if not is_causal and self.load_balance:
            found.append("is_causal=False with load balancing: the head-tail reordering assumes causal attention; "
                         "set parallelism_config.cp_load_balance: false for bidirectional attention")
        return found


@contextlib.contextmanager
def context_parallel(cp_mesh: Any, buffers: Sequence[Any], buffer_seq_dims: Sequence[int],
                     no_restore_buffers: Sequence[Any], *, comm_strategy: str = "allgather",
                     load_balance: bool = True, planning: bool = False) -> Iterator[None]:
    """Shard ``buffers`` over ``cp_mesh`` along ``buffer_seq_dims`` (in place; restored on exit
    unless in ``no_restore_buffers``) and run SDPA as ring attention inside. Raises
    :class:`ConfigError` for what it would get wrong (module docstring); in a planned run
    (``planning``) on a CPU, :class:`PlanningUnsupported`: the target's CUDA run is fine, the plan
    cannot step it here."""
    problems = buffer_problems(cp_mesh.size(), buffers, buffer_seq_dims, no_restore_buffers, load_balance)
    if cp_mesh.device_type != "cuda" and planning:
        raise PlanningUnsupported(f"{KEY}: context parallel's step cannot be planned on {cp_mesh.device_type} "
                                  f"(torch {torch.__version__}: the {cp_mesh.device_type} attention kernel has no "
                                  "sharding rule for ring attention; the target's CUDA kernels have one); the layout "
                                  "is planned, the step's memory, collectives and time are not")
    if cp_mesh.device_type != "cuda":
        problems.insert(0, f"{KEY}: context parallel runs on CUDA devices only (torch {torch.__version__}: the "
                           f"{cp_mesh.device_type} attention kernel has no sharding rule); this run is on "
                           f"{cp_mesh.device_type}. Without the context the cp ranks compute the whole sequence each")
    if comm_strategy not in COMM_STRATEGIES:
        problems.append(f"parallelism_config.cp_comm_strategy: {comm_strategy!r}; choose {' or '.join(COMM_STRATEGIES)}")
    if problems:
        raise ConfigError(problems, header="accelerator.maybe_context_parallel")
    with ring_attention(cp_mesh, buffers, buffer_seq_dims, no_restore_buffers, comm_strategy=comm_strategy,
                        load_balance=load_balance):
        yield


@contextlib.contextmanager
def ring_attention(cp_mesh: Any, buffers: Sequence[Any], buffer_seq_dims: Sequence[int],
                   no_restore_buffers: Sequence[Any], *, comm_strategy: str, load_balance: bool) -> Iterator[None]:
    """Torch's context parallel with the :class:`AttentionGuard` around its SDPA and the math backend
    excluded; raises on exit when no SDPA call ran. The checks of :func:`context_parallel` come
    first; this part runs on any device (on a CPU, until the first attention call)."""
    from torch.distributed.tensor.experimental import context_parallel as torch_context_parallel
    from torch.distributed.tensor.experimental._attention import _cp_options, set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    functional = torch.nn.functional
    previous = _cp_options.enable_load_balance
    _cp_options.enable_load_balance = load_balance  # read by torch when it shards the buffers
    set_rotate_method(comm_strategy)
    guard = None
    try:
        kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        with torch_context_parallel(cp_mesh, buffers=list(buffers), buffer_seq_dims=list(buffer_seq_dims),
                                    no_restore_buffers=set(no_restore_buffers)), sdpa_kernel(kernels):
            patched = functional.scaled_dot_product_attention  # torch's ring attention, installed just now
            guard = AttentionGuard(patched, load_balance)
            functional.scaled_dot_product_attention = guard
            try:
                yield
            finally:
                functional.scaled_dot_product_attention = patched
    finally:
        _cp_options.enable_load_balance = previous
    if guard.calls == 0:
        raise ConfigError([f"{KEY}: no torch.nn.functional.scaled_dot_product_attention call ran inside the context, "
                           "so nothing was computed as ring attention: the model's attention is eager (or binds SDPA "
                           "under another name) and attended within each rank's chunk only. Use SDPA attention "
                           "(transformers: attn_implementation='sdpa')"], header="accelerator.maybe_context_parallel")


__all__ = ["COMM_STRATEGIES", "KEY", "AttentionGuard", "buffer_problems", "context_parallel", "ring_attention"]
