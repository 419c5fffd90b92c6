"""Context parallel without the kernel: the checks of the tensors to shard, the refusals of attention that
torch's ring attention would compute wrongly, and the refusal on a device without the kernel (every CPU).
The ring attention itself runs on the GPU tier (plugins/fsdp/tests/test_context_parallel_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torchrig.accelerator.context_parallel import AttentionGuard, buffer_problems, context_parallel
from torchrig.errors import ConfigError


def test_buffers_must_split_evenly_at_the_same_positions():
    ids, labels = torch.zeros(2, 16, dtype=torch.long), torch.zeros(2, 16, dtype=torch.long)
    assert buffer_problems(2, [ids, labels], [1, 1], [labels], load_balance=True) == []
    assert buffer_problems(4, [ids], [1], [], load_balance=False) == []
    # head-tail load balancing cuts the sequence into 2 x cp_size chunks
    twelve = torch.zeros(2, 12, dtype=torch.long)
    (problem,) = buffer_problems(4, [twelve], [1], [], load_balance=True)
    assert "sequence length 12 is not a multiple of 8" in problem and "cp_load_balance: false" in problem
    assert buffer_problems(4, [twelve], [1], [], load_balance=False) == []
    problems = buffer_problems(2, [ids, torch.zeros(2, 12)], [1, 1], [torch.zeros(1)], load_balance=False)
    assert any("lengths differ (16, 12)" in p for p in problems)
    assert any("no_restore_buffers" in p for p in problems)
    assert "one per buffer" in buffer_problems(2, [ids], [1, 1], [], load_balance=True)[0]
    assert "no tensor to shard" in buffer_problems(2, [], [], [], load_balance=True)[0]
    weight = torch.zeros(4, 16, requires_grad=True)
    assert any("requires grad" in p for p in buffer_problems(2, [weight], [1], [], load_balance=False))
    assert any("has 2 dimensions" in p for p in buffer_problems(2, [ids], [2], [], load_balance=False))


def _qkv(q_len=8, k_len=8):
    return torch.randn(1, 2, q_len, 4), torch.randn(1, 2, k_len, 4), torch.randn(1, 2, k_len, 4)


def test_the_guard_passes_causal_self_attention_through_and_counts_it():
    seen = []

    def attention(query, key, value, **kwargs):
        seen.append(kwargs)
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, **kwargs)

    guard = AttentionGuard(attention, load_balance=True)
    q, k, v = _qkv()
    out = guard(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5))
    assert guard.calls == 1 and seen == [{"dropout_p": 0.0, "is_causal": True, "scale": 0.5}]
    # bidirectional attention is fine without the head-tail reordering
    AttentionGuard(attention, load_balance=False)(q, k, v)


@pytest.mark.parametrize(("call", "message"), [
    (lambda g, q, k, v: g(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool)), "attn_mask: an explicit attention mask"),
    (lambda g, q, k, v: g(q, *_qkv(8, 12)[1:], is_causal=False), "query length 8 != key length 12"),
    (lambda g, q, k, v: g(q, k, v, is_causal=True, enable_gqa=True), "enable_gqa=True"),
    (lambda g, q, k, v: g(q, k, v), "is_causal=False with load balancing"),
    (lambda g, q, k, v: g(q[0], k[0], v[0], is_causal=True), "query has 3 dimensions"),
])
def test_the_guard_refuses_attention_the_ring_kernels_would_get_wrong(call, message):
    def attention(*args, **kwargs):
        raise AssertionError("a refused call must not reach the kernel")

    guard = AttentionGuard(attention, load_balance=True)
    with pytest.raises(ConfigError, match="context parallel cannot shard this attention") as excinfo:
        call(guard, *_qkv())
    assert message in str(excinfo.value) and guard.calls == 0


class _Mesh:
    """What the refusals read of a DeviceMesh (they run before torch is asked for anything)."""

    def __init__(self, device_type: str, size: int) -> None:
        self.device_type, self._size = device_type, size

    def size(self) -> int:
        return self._size


def test_a_device_without_the_kernel_is_refused_before_any_buffer_is_sharded():
    ids = torch.arange(32).reshape(2, 16)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with pytest.raises(ConfigError) as excinfo:
        with context_parallel(_Mesh("cpu", 2), [ids], [1], [], comm_strategy="ring"):
            pass
    text = str(excinfo.value)
    assert "parallelism_config.cp_size: context parallel runs on CUDA devices only" in text and "on cpu" in text
    assert "parallelism_config.cp_comm_strategy: 'ring'" in text
    assert ids.shape == (2, 16) and torch.nn.functional.scaled_dot_product_attention is sdpa
