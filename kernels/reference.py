"""Torch references for the paged-attention kernels: the CPU path and the oracle for Triton.

Cache layout everywhere: `[num_blocks, block_size, num_kv_heads, head_dim]` (NHD). A token at
logical position `p` of a sequence lives in block `block_tables[b, p // block_size]`, row
`p % block_size`. `slot = block * block_size + row`; a slot of -1 is padding and is skipped.
"""
from __future__ import annotations

import torch


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `key/value[T, Hkv, D]` into the caches at `slot_mapping[T]`, skipping slots < 0."""
    num_blocks, block_size = k_cache.shape[:2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_flat = k_cache.view(num_blocks * block_size, *k_cache.shape[2:])
    v_flat = v_cache.view(num_blocks * block_size, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, key[valid].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value[valid].to(v_cache.dtype))


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence's pages as a contiguous `[length, Hkv, D]`."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    pages = cache[block_table[:num_blocks].long()]
    return pages.reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            mask: torch.Tensor | None) -> torch.Tensor:
    """q[Tq, Hq, D], k/v[Tk, Hkv, D], mask[Tq, Tk] (True = visible) -> [Tq, Hq, D] in float32."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    group = num_heads // num_kv_heads
    qf = q.float().reshape(q.shape[0], num_kv_heads, group, q.shape[2])
    scores = torch.einsum("qhgd,khd->hgqk", qf, k.float()) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.reshape(q.shape[0], num_heads, q.shape[2])


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, *,
                         scale: float) -> torch.Tensor:
    """Standard decode attention: one query token per sequence, one pass over its whole KV.

    q[B, Hq, D] -> out[B, Hq, D] (q's dtype). Computed in float32 with padding masked out.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max().item()) if batch else 0
    if max_len == 0:
        return torch.zeros_like(q)
    num_pages = (max_len + block_size - 1) // block_size
    pages = block_tables[:, :num_pages].long()
    k = k_cache[pages].reshape(batch, num_pages * block_size, num_kv_heads, head_dim).float()
    v = v_cache[pages].reshape(batch, num_pages * block_size, num_kv_heads, head_dim).float()
    group = num_heads // num_kv_heads
    qf = q.float().reshape(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bkhd->bhgk", qf, k) * scale
    positions = torch.arange(num_pages * block_size, device=q.device)
    visible = positions[None, :] < seq_lens[:, None].to(q.device)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgk,bkhd->bhgd", probs, v)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Causal attention for a batch of query chunks over paged KV (prefix already cached).

    q[T, Hq, D] holds each sequence's new tokens back to back (`query_start_loc[B+1]`); the
    new tokens are the last `q_len` of `seq_lens[b]` context tokens, whose K/V (cached prefix
    and new tokens alike) are already in the pages. Returns out[T, Hq, D].
    """
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for b, context_len in enumerate(lens):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], context_len)
        v = gather_kv_ref(v_cache, block_tables[b], context_len)
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        k_pos = torch.arange(context_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out[q_start:q_end] = _attend(q[q_start:q_end], k, v, scale, mask).to(q.dtype)
    return out
