"""Torch references for the paged-attention kernels: the CPU path and the oracle for Triton.

Cache layout everywhere: `[num_blocks, block_size, num_kv_heads, head_dim]` (NHD). A token at
logical position `p` of a sequence lives in block `block_tables[b, p // block_size]`, row
`p % block_size`. `slot = block * block_size + row`; a slot of -1 is padding and is skipped.
FP8 pages hold codes (`kernels.attention.kv_quant`): every function takes the per-head `k_scale` /
`v_scale` beside the caches (None for other dtypes) and computes over the dequantized values.
"""
from __future__ import annotations

import torch

from kernels.attention.kv_quant import check_scales, dequantize_kv, store_rows


def key_pages_ref(pages: torch.Tensor, key_page_map: torch.Tensor | None) -> torch.Tensor:
    """The K cache pages holding these KV pages' keys (-1: none); see `kernels.attention.kv_store`."""
    return pages if key_page_map is None else key_page_map.to(pages.device)[pages].long()


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor, key_page_map: torch.Tensor | None = None,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Write `key/value[T, Hkv, D]` into the caches at `slot_mapping[T]`, skipping slots < 0; keys
    at page key_page_map[slot // block_size] of k_cache when given (`kernels.attention.kv_store.store_kv`)."""
    check_scales(k_cache, k_scale, "store_kv_ref")
    check_scales(v_cache, v_scale, "store_kv_ref")
    block_size = v_cache.shape[1]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_slots = slots if key_page_map is None else (
        key_pages_ref(slots // block_size, key_page_map) * block_size + slots % block_size)
    store_rows(k_cache, k_slots, key[valid], k_scale)
    store_rows(v_cache, slots, value[valid], v_scale)


def gather_kv_ref(cache: torch.Tensor, block_table: torch.Tensor, length: int,
                  scale: torch.Tensor | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The first `length` tokens of one sequence's pages as a contiguous `[length, Hkv, D]`: in
    the cache's dtype, or dequantized / cast to `dtype` (float32 when an FP8 cache's `scale` is given)."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    pages = cache[block_table[:num_blocks].long()]
    tokens = pages.reshape(num_blocks * block_size, *cache.shape[2:])[:length]
    if scale is None and dtype is None:
        return tokens
    return dequantize_kv(tokens, scale, dtype or torch.float32)


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
                         scale: float, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> torch.Tensor:
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
    k = dequantize_kv(k_cache[pages].reshape(batch, num_pages * block_size, num_kv_heads, head_dim), k_scale)
    v = dequantize_kv(v_cache[pages].reshape(batch, num_pages * block_size, num_kv_heads, head_dim), v_scale)
    group = num_heads // num_kv_heads
    qf = q.float().reshape(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bkhd->bhgk", qf, k) * scale
    positions = torch.arange(num_pages * block_size, device=q.device)
    visible = positions[None, :] < seq_lens[:, None].to(q.device)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    v = v.masked_fill(~visible[:, :, None, None], 0.0)  # stale padding may hold NaN; 0 * NaN = NaN
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgk,bkhd->bhgd", probs, v)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, *, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
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
        k = gather_kv_ref(k_cache, block_tables[b], context_len, k_scale)
        v = gather_kv_ref(v_cache, block_tables[b], context_len, v_scale)
        q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
        k_pos = torch.arange(context_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out[q_start:q_end] = _attend(q[q_start:q_end], k, v, scale, mask).to(q.dtype)
    return out


# ----- split-KV decode (Flash-Decoding) and asynchronous softmax (FlashDecoding++) -----------
#
# These mirror the Triton kernels' arithmetic: KV is walked in tiles of `block_n` tokens; a
# sequence of length L is cut into `n = ceil(L / chunk)` splits of `chunk` tokens (a multiple of
# `block_n`, see `split_plan`). "flash" keeps a (max, sum, acc) per split and merges them with
# log-sum-exp weights; "fdpp" exponentiates every score against one unified max φ, so the
# partials are plain sums (no rescale, no max exchange) and only a range check remains.

LOG2E = 1.4426950408889634


def split_plan(seq_lens: torch.Tensor, max_splits: int, block_n: int,
               min_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence: tokens per split (`chunk`, a multiple of block_n) and number of splits.

    The kernels compute exactly this on the device from `seq_lens`, so one static grid of
    `max_splits` programs per (sequence, KV head) serves every length (CUDA-graph safe).
    """
    lens = seq_lens.long()
    per_split = (lens + max_splits - 1) // max_splits
    chunk = (per_split + block_n - 1) // block_n * block_n
    min_chunk = (min_chunk + block_n - 1) // block_n * block_n
    chunk = torch.clamp(chunk, min=max(min_chunk, block_n))
    num_splits = torch.clamp((lens + chunk - 1) // chunk, min=1)
    return chunk, num_splits


def safe_window(dtype: torch.dtype) -> tuple[float, float]:
    """(LO, HI) for `row_max - φ` in log2 units under which the async softmax stays accurate.

    P = 2^(s-φ) is cast to the KV dtype for the P·V product. bf16 (and fp32) share fp32's
    exponent range: HI = 64 leaves 2^63 of headroom for summing up to 2^20 tokens times |v|,
    LO = -64 keeps the row's largest P far above the 2^-126 normal limit. fp16 P overflows at
    65504 ≈ 2^16 and loses precision below 2^-14, so its window is narrow.
    """
    if dtype == torch.float16:
        return -8.0, 15.0
    return -64.0, 64.0


def paged_scores(q, k_cache, v_cache, block_tables, seq_lens, scale, block_n, k_scale=None, v_scale=None):
    """Scores [B, Hkv, G, T, block_n] (masked with -inf), V [B, T, block_n, Hkv, D] in float32."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    max_len = int(seq_lens.max().item())
    num_tiles = (max_len + block_n - 1) // block_n
    padded = num_tiles * block_n
    num_pages = (padded + block_size - 1) // block_size
    table = block_tables[:, :num_pages].long()
    if table.shape[1] < num_pages:   # the tile padding may reach past the table: point it anywhere
        table = torch.nn.functional.pad(table, (0, num_pages - table.shape[1]))
    k = dequantize_kv(k_cache[table].reshape(batch, num_pages * block_size, num_kv_heads, head_dim)[:, :padded],
                      k_scale)
    v = dequantize_kv(v_cache[table].reshape(batch, num_pages * block_size, num_kv_heads, head_dim)[:, :padded],
                      v_scale)
    group = num_heads // num_kv_heads
    qf = q.float().reshape(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bkhd->bhgk", qf, k) * scale
    visible = torch.arange(padded, device=q.device)[None, :] < seq_lens[:, None].to(q.device)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    scores = scores.reshape(batch, num_kv_heads, group, num_tiles, block_n)
    return scores, v.reshape(batch, num_tiles, block_n, num_kv_heads, head_dim)


def _split_of_tile(seq_lens, chunk, num_tiles, block_n):
    """[B, T] split index of each tile (tiles past the sequence go to the last split: empty)."""
    tile_start = torch.arange(num_tiles, device=seq_lens.device)[None, :] * block_n
    return torch.div(tile_start, chunk[:, None].to(seq_lens.device), rounding_mode="floor")


def _per_split_sum(values: torch.Tensor, split_idx: torch.Tensor, num_splits: int) -> torch.Tensor:
    """Sum `values[B, Hkv, G, T, ...]` over the tiles of each split -> [B, Hkv, G, S, ...]."""
    shape = list(values.shape)
    shape[3] = num_splits
    idx = split_idx[:, None, None, :].expand(values.shape[:4])
    idx = idx.reshape(*idx.shape, *([1] * (values.dim() - 4))).expand(values.shape)
    return values.new_zeros(shape).scatter_add_(3, idx, values)


def _split_partials(scores, v, seq_lens, max_splits, block_n, min_chunk):
    """Exact per-split (max m, sum l, unnormalised acc) in natural-log units."""
    batch, num_kv_heads, group, num_tiles, _ = scores.shape
    chunk, num_splits = split_plan(seq_lens, max_splits, block_n, min_chunk)
    split_idx = _split_of_tile(seq_lens, chunk, num_tiles, block_n).clamp(max=int(num_splits.max()) - 1)
    s_count = int(num_splits.max())
    idx = split_idx[:, None, None, :].expand(batch, num_kv_heads, group, num_tiles)
    m = scores.new_full((batch, num_kv_heads, group, s_count), float("-inf"))
    m = m.scatter_reduce(3, idx, scores.amax(-1), reduce="amax")
    m_tile = m.gather(3, idx)
    p = torch.exp(scores - torch.where(torch.isfinite(m_tile), m_tile, 0.0)[..., None])
    l_split = _per_split_sum(p.sum(-1), split_idx, s_count)
    acc_tile = torch.einsum("bhgtn,btnhd->bhgtd", p, v)
    acc_split = _per_split_sum(acc_tile, split_idx, s_count)
    return m, l_split, acc_split


def flash_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                     max_splits: int, block_n: int = 64, min_chunk: int = 256,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Flash-Decoding: per-split partial softmax, then the exact log-sum-exp merge."""
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return torch.empty_like(q)
    scores, v = paged_scores(q, k_cache, v_cache, block_tables, seq_lens, scale, block_n, k_scale, v_scale)
    m, l_split, acc_split = _split_partials(scores, v, seq_lens, max_splits, block_n, min_chunk)
    m_all = m.amax(-1, keepdim=True)
    weight = torch.where(torch.isfinite(m), torch.exp(m - m_all), 0.0)        # empty splits weigh 0
    num = (acc_split * weight[..., None]).sum(3)
    den = (l_split * weight).sum(3)
    out = num / torch.where(den > 0, den, 1.0)[..., None]
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def estimate_phi_ref(scores: torch.Tensor, seq_lens: torch.Tensor, sink: int, window: int) -> torch.Tensor:
    """φ per row [B, Hkv, G]: the max score over the first `sink` and the last `window` tokens."""
    batch, num_kv_heads, group = scores.shape[:3]
    flat = scores.reshape(batch, num_kv_heads, group, -1)
    pos = torch.arange(flat.shape[-1], device=scores.device)[None, :]
    lens = seq_lens[:, None].to(scores.device)
    chosen = ((pos < sink) | (pos >= lens - window)) & (pos < lens)
    return flat.masked_fill(~chosen[:, None, None, :], float("-inf")).amax(-1)


def fdpp_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                    max_splits: int, phi: float | None = None, fallback: bool = True,
                    stats: torch.Tensor | None = None, block_n: int = 64, min_chunk: int = 256,
                    phi_sink: int = 4, phi_window: int = 28, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """FlashDecoding++: partials exponentiated against one unified max φ, merged by plain sums.

    `phi` is in the units of the scaled scores (q·k·scale, natural log); None estimates it per
    row from the sink and local-window tokens. A row whose true max leaves the safe window
    around φ (see `safe_window`, checked in log2 units like the kernel) is flagged; with
    `fallback` it is recomputed exactly. `stats[0] += flagged rows` (int64, in place).
    """
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return torch.empty_like(q)
    scores, v = paged_scores(q, k_cache, v_cache, block_tables, seq_lens, scale, block_n, k_scale, v_scale)
    if phi is None:
        phi_row = estimate_phi_ref(scores, seq_lens, phi_sink, phi_window)
        phi_row = torch.where(torch.isfinite(phi_row), phi_row, 0.0)   # empty sequences
    else:
        phi_row = scores.new_full(scores.shape[:3], float(phi))
    chunk, num_splits = split_plan(seq_lens, max_splits, block_n, min_chunk)
    split_idx = _split_of_tile(seq_lens, chunk, scores.shape[3], block_n).clamp(max=int(num_splits.max()) - 1)
    p = torch.exp(scores - phi_row[..., None, None])
    s_count = int(num_splits.max())
    l_split = _per_split_sum(p.sum(-1), split_idx, s_count)           # partials: no rescale...
    acc_split = _per_split_sum(torch.einsum("bhgtn,btnhd->bhgtd", p, v), split_idx, s_count)
    den, num = l_split.sum(3), acc_split.sum(3)                       # ...and the merge is a sum
    out = num / torch.where(den == 0, 1.0, den)[..., None]
    lo, hi = safe_window(q.dtype if k_scale is not None else v_cache.dtype)   # FP8 pages: P·V in q's dtype
    excess = (scores.amax((-1, -2)) - phi_row) * LOG2E
    flagged = (excess > hi) | (excess < lo) | ~torch.isfinite(den) | (den <= 0)
    flagged &= (seq_lens > 0).to(flagged.device)[:, None, None]       # an empty row has nothing to check
    if stats is not None:
        stats[0] += int(flagged.sum())
    if fallback and bool(flagged.any()):
        exact = flash_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                 max_splits=max_splits, block_n=block_n, min_chunk=min_chunk,
                                 k_scale=k_scale, v_scale=v_scale)
        exact = exact.float().reshape(out.shape)
        out = torch.where(flagged[..., None], exact, out)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                     variant: str, num_splits: int | None = None, max_splits_default: int = 8,
                     **options) -> torch.Tensor:
    """`kernels.decode_attention`'s signature, in torch: the CPU path and the kernels' oracle.

    "standard": one pass over the whole KV; "flash": split + log-sum-exp merge; "fdpp": unified
    max φ (options: phi, fallback, stats, phi_sink, phi_window). `num_splits` caps the splits per
    sequence (None or 0: `max_splits_default`, the CPU stand-in for the GPU's wave heuristic).
    Also accepts block_n / min_chunk so a test can mirror a kernel config exactly.
    """
    max_splits = num_splits or max_splits_default
    if variant == "standard":
        return decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                    k_scale=options.get("k_scale"), v_scale=options.get("v_scale"))
    if variant == "flash":
        return flash_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                max_splits=max_splits, **options)
    if variant == "fdpp":
        return fdpp_decode_ref(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                               max_splits=max_splits, **options)
    raise ValueError(f"unknown decode variant {variant!r}; expected 'standard', 'flash' or 'fdpp'")
