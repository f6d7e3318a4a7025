"""The C++ RoPE + KV store against the torch form it replaces on the CPU (`RotaryEmbedding` then the index-copy
store): bit for bit on bf16 and float32 rows, full and partial rotary, padding slots skipped, rows as views into one
projection."""
from __future__ import annotations

import pytest
import torch

from engine.model.layers import RotaryEmbedding
from kernels.attention.reference import store_kv_ref
from kernels.native.rope_store import rope_store_rows, takes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotary_dim", [64, 32])
@pytest.mark.parametrize("tokens", [1, 5, 63, 64, 300])
def test_matches_the_torch_form_bit_for_bit(rotary_dim, tokens, dtype):
    gen = torch.Generator().manual_seed(tokens * 100 + rotary_dim)
    rope = RotaryEmbedding(64, rotary_dim, 8192, 100000.0)
    qkv = (torch.randn(tokens, (9 + 2 * 3) * 64, generator=gen) * 3).to(dtype)
    q, k, v = qkv[:, :576], qkv[:, 576:768], qkv[:, 768:]
    positions = torch.randint(0, 8192, (tokens,), generator=gen)
    slots = torch.randperm(60 * 16, generator=gen)[:tokens]
    slots[::4] = -1                                        # padding rows are not stored
    k_cache = torch.randn(60, 16, 3, 64, generator=gen).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen).to(dtype)
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    q_expected, k_rotated = rope(positions, q, k)
    store_kv_ref(k_rotated.reshape(tokens, 3, 64), v.reshape(tokens, 3, 64), k_expected, v_expected, slots)
    assert takes(q, k, v, k_cache, v_cache, rope.cos_cache, rope.sin_cache)
    out = rope_store_rows(positions, q, k, v, rope.cos_cache, rope.sin_cache, 64, rotary_dim, k_cache, v_cache, slots)
    assert torch.equal(out, q_expected)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)


def test_refuses_what_it_does_not_take():
    rope = RotaryEmbedding(64, 64, 128, 10000.0)
    qkv = torch.randn(2, 15 * 64).bfloat16()
    q, k, v = qkv[:, :576], qkv[:, 576:768], qkv[:, 768:]
    cache = torch.zeros(4, 16, 3, 64).bfloat16()
    assert not takes(q.float(), k.float(), v.float(), cache, cache, rope.cos_cache, rope.sin_cache)
    assert not takes(q.double(), k.double(), v.double(), cache.double(), cache.double(), rope.cos_cache,
                     rope.sin_cache)
    with pytest.raises(ValueError, match="slot past the pages"):
        rope_store_rows(torch.tensor([0, 1]), q, k, v, rope.cos_cache, rope.sin_cache, 64, 64, cache, cache.clone(),
                        torch.tensor([0, 64]))
    with pytest.raises(ValueError, match="position past"):
        rope_store_rows(torch.tensor([0, 128]), q, k, v, rope.cos_cache, rope.sin_cache, 64, 64, cache, cache.clone(),
                        torch.tensor([0, 1]))
