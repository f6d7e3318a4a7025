"""Paged attention tuned for the CPU: torch's fused kernels over gathered K/V, no per-page Python.

Same signatures and cache layout as `kernels.attention.reference` (its torch references stay the
oracle). Prefill runs SDPA's CPU flash kernel over each sequence's gathered K/V (a long chunk's own
keys causal, its cached prefix unmasked, merged by log-sum-exp); decode is one exact pass through SDPA
too: short batches gathered once, long sequences read in place (a run of consecutive pages in the
NHD layout is a strided [tokens, Hkv, D] view), cut into chunks attended as one batch and merged by
their log-sum-exps (split-KV on the CPU: the flash kernel parallelises over batch x heads only, and
one sequence has a few KV heads). In prefill a group's query heads see their KV head expanded,
because SDPA's `enable_gqa` on the CPU is several times slower than the expanded call. FP8 pages
(`kernels.attention.kv_quant`) are dequantized as they are read: a gather, or each run of pages
converted once per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention.kv_quant import dequantize_kv, store_rows
from kernels.attention.page_runs import PageRun, page_runs, run_view
from kernels.attention.reference import gather_kv_ref, store_kv_ref


def _heads_first(kv: torch.Tensor, group: int) -> torch.Tensor:
    """[L, Hkv, D] -> [Hkv * group, L, D], each KV head repeated for its `group` query heads."""
    length, num_kv_heads, head_dim = kv.shape
    heads = kv.permute(1, 0, 2)
    if group == 1:
        return heads
    return heads[:, None].expand(num_kv_heads, group, length, head_dim).reshape(num_kv_heads * group, length,
                                                                                   head_dim)


def store_kv_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, has_padding: bool | None = None) -> None:
    """`reference.store_kv_ref` without its padding mask when no slot is padding (-1), as on the
    CPU's eager steps: two index copies instead of a mask, its nonzero and two masked gathers.
    `has_padding` (whether any slot is -1) when the caller knows it, else it is looked up."""
    if slot_mapping.numel() == 0:
        return
    if has_padding is None:
        has_padding = slot_has_padding(slot_mapping)
    if has_padding:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    slots = slot_mapping.long()
    store_rows(k_cache, slots, key, k_scale)
    store_rows(v_cache, slots, value, v_scale)


def slot_has_padding(slot_mapping: torch.Tensor) -> bool:
    """Whether any of a step's slots is padding (-1): asked once per step, every layer stores to the same slots."""
    return slot_mapping.numel() > 0 and int(slot_mapping.min()) < 0


def prefill_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, *, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.prefill_attention_ref` through SDPA: q[T, Hq, D] of each sequence's new tokens
    (the last q_len of its seq_lens[b] tokens, whose K/V are in the pages) -> out[T, Hq, D].

    A long chunk after a cached prefix (at least `SPLIT_MIN_ROWS` rows) is two flash calls merged by their
    log-sum-exps: the chunk's own keys with `is_causal` and the prefix keys without a mask, since one call
    with the bottom-right mask walks every masked block too (bench/RESULTS.md). A short chunk keeps the
    one masked call: its masked blocks are few, and its rows come out bit for bit as the whole prompt's
    causal call computes them, so a prompt prefilled in one chunk and sent again, served from the prefix
    cache, samples what it sampled the first time (a longer prompt's split chunks differ from such a
    repeat in the last bits)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    starts = query_start_loc.tolist()
    for b, context_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = _heads_first(gather_kv_ref(k_cache, block_tables[b], context_len, k_scale, q.dtype), group)[None]
        v = _heads_first(gather_kv_ref(v_cache, block_tables[b], context_len, v_scale, q.dtype), group)[None]
        qh = q[q_start:q_end].transpose(0, 1)[None]     # 4-D: SDPA's CPU flash kernel takes no 3-D input
        cached = context_len - q_len
        if cached == 0:
            o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale)
        elif q_len < SPLIT_MIN_ROWS:   # the causal diagonal sits at the bottom right
            q_pos = torch.arange(cached, context_len, device=q.device)
            mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale)
        else:
            own = _flash_cpu(qh, k[:, :, cached:], v[:, :, cached:], scale, causal=True)
            before = _flash_cpu(qh, k[:, :, :cached], v[:, :, :cached], scale, causal=False)
            o = _merge_by_lse([own, before])[None].to(q.dtype)
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


# Rows from which a chunk after a cached prefix is attended in two calls (its own keys causal, the prefix unmasked).
SPLIT_MIN_ROWS = 512


def _flash_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel on [N, H, L, D] inputs -> (out [N, H, Lq, D], log-sum-exp [N, H, Lq] float32);
    `causal`: query i sees keys 0..i (top-left, the chunk over its own keys)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal, scale=scale)[:2]
    return out, lse


def _merge_by_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over disjoint key sets [N_i, H, Lq, D] (with their log-sum-exps) merged exactly into one
    over all of them: float32 [H, Lq, D]."""
    weights = torch.softmax(torch.cat([lse for _, lse in parts]), dim=0)
    return (weights[..., None] * torch.cat([out for out, _ in parts]).float()).sum(0)


# A padded gather of the whole batch is cheaper than a Python loop over sequences while the batch's
# pages are short; past this many tokens each sequence reads its pages in place (no copy).
GATHER_MAX_LEN = 1024
# A lone sequence is gathered up to this length (one SDPA call instead of one per run of pages): decode at
# 100 tokens of context 19.4 against 20.3 ms a token, even at 500, 1.04x slower at 1,000 (embedded default,
# 2-core AVX512/AMX CPU).
GATHER_MAX_LEN_ONE = 512
# A lone piece of KV up to this many tokens is one SDPA call; a longer one is cut into up to `KV_SPLITS`
# chunks of at least `KV_SPLIT_MIN_CHUNK` tokens, one batched call (embedded default, 2 threads of an
# AVX512/AMX CPU: 32.6 against 41.2 ms a token at 5,700 tokens of context, 23.7 against 26.7 at 3,000).
KV_SPLIT_MIN_LEN = 1024
KV_SPLITS = 4
KV_SPLIT_MIN_CHUNK = 512
# A block table in more pieces than this is gathered instead (each piece costs an SDPA call).
MAX_PAGE_RUNS = 16


@dataclass(frozen=True)
class DecodeLayout:
    """Where a decode step's K/V lie, worked out once per step: every layer reads the same pages.

    Short steps are gathered (`pages`: each sequence's first `num_pages` block ids, int64; for a batch
    `mask`, [B, 1, 1, padded] True on real tokens, and `padding`, [B, padded, 1, 1] its complement);
    longer ones read each sequence's `runs` in place."""

    max_len: int
    runs: list[list[PageRun]] | None = None
    pages: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    padding: torch.Tensor | None = None


def decode_layout(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> DecodeLayout:
    """The step's `DecodeLayout` for `decode_attention_cpu`."""
    batch = seq_lens.shape[0]
    max_len = int(seq_lens.max()) if batch else 0
    if max_len == 0:
        return DecodeLayout(0)
    if max_len > (GATHER_MAX_LEN_ONE if batch == 1 else GATHER_MAX_LEN):
        return DecodeLayout(max_len, runs=page_runs(block_tables, seq_lens, block_size))
    num_pages = (max_len + block_size - 1) // block_size
    pages = block_tables[:, :num_pages].long()
    if batch == 1:
        return DecodeLayout(max_len, pages=pages)
    visible = torch.arange(num_pages * block_size, device=seq_lens.device)[None, :] < seq_lens[:, None]
    return DecodeLayout(max_len, pages=pages, mask=visible[:, None, None, :], padding=~visible[:, :, None, None])


def decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                         layout: DecodeLayout | None = None, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.decode_attention_ref` without per-page Python: q[B, Hq, D] -> [B, Hq, D].

    A batch whose sequences are all short is gathered and padded once (one SDPA call); otherwise each
    sequence attends its pages where they lie, one call per run of consecutive pages. `layout` (from
    `decode_layout`) says which: computed here when not given, or once per step by the caller.
    Softmax and accumulation are float32 (or float64 for float64 inputs)."""
    if layout is None:
        layout = decode_layout(block_tables, seq_lens, k_cache.shape[1])
    if layout.max_len == 0:
        return torch.zeros_like(q)
    if layout.runs is None:
        return _decode_gathered(q, k_cache, v_cache, layout, scale, k_scale, v_scale)
    out = torch.empty_like(q)
    for b, seq_runs in enumerate(layout.runs):
        if not seq_runs:
            out[b].zero_()
            continue
        if len(seq_runs) > MAX_PAGE_RUNS:
            length = sum(run.num_tokens for run in seq_runs)
            keys = [gather_kv_ref(k_cache, block_tables[b], length)]
            values = [gather_kv_ref(v_cache, block_tables[b], length)]
        else:
            keys = [run_view(k_cache, run) for run in seq_runs]
            values = [run_view(v_cache, run) for run in seq_runs]
        if k_scale is not None:   # FP8 codes: converted once, the scale folded in
            keys = [dequantize_kv(k, k_scale) for k in keys]
        if v_scale is not None:
            values = [dequantize_kv(v, v_scale) for v in values]
        out[b] = _attend_one(q[b], keys, values, scale)
    return out


def _attend_one(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                scale: float) -> torch.Tensor:
    """One query token q[Hq, D] over its KV in pieces (contiguous [n_i, Hkv, D] views of the pages) ->
    [Hq, D] in q's dtype, through SDPA's CPU flash kernel with a group's query heads as the rows of their
    KV head. Pieces longer than `KV_SPLIT_MIN_LEN` are cut into up to `KV_SPLITS` equal chunks that one
    call takes as a batch: the kernel parallelises over batch x heads only, and a lone sequence's few KV
    heads leave a core idle. Every chunk's output is merged by its log-sum-exp, exactly."""
    num_kv_heads, head_dim = keys[0].shape[1], keys[0].shape[2]
    dtype = keys[0].dtype
    qg = q.to(dtype).view(1, num_kv_heads, -1, head_dim)
    if len(keys) == 1 and keys[0].shape[0] <= KV_SPLIT_MIN_LEN:
        out = F.scaled_dot_product_attention(qg, keys[0].permute(1, 0, 2)[None], values[0].permute(1, 0, 2)[None],
                                             scale=scale)
        return out.reshape(q.shape).to(q.dtype)
    parts = [_flash_cpu(qg.expand(k_chunks.shape[0], -1, -1, -1), k_chunks, v_chunks, scale)   # [n, Hkv, G, D]
             for k, v in zip(keys, values, strict=True)
             for k_chunks, v_chunks in zip(_chunks(k), _chunks(v), strict=True)]
    return _merge_by_lse(parts).reshape(q.shape).to(q.dtype)


def _chunks(kv: torch.Tensor) -> list[torch.Tensor]:
    """kv[n, Hkv, D] (contiguous rows) as [splits, Hkv, chunk, D] views of equal chunks, plus the rest."""
    length = kv.shape[0]
    splits = min(KV_SPLITS, max(1, length // KV_SPLIT_MIN_CHUNK)) if length > KV_SPLIT_MIN_LEN else 1
    chunk = length // splits
    full = chunk * splits
    parts = [kv[:full].view(splits, chunk, *kv.shape[1:]).transpose(1, 2)]
    if full < length:
        parts.append(kv[full:].transpose(0, 1)[None])
    return parts


def _decode_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: DecodeLayout,
                     scale: float, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> torch.Tensor:
    """The batch's pages gathered into one padded [B, padded, Hkv, D] per cache, attended by one SDPA
    call (a group's query heads as the rows of its KV head); one sequence is cut to its length, a
    batch's padding is masked and zeroed (stale pages may hold NaN, and 0 * NaN = NaN)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert layout.pages is not None
    pages = layout.pages.flatten()
    padded = layout.pages.shape[1] * block_size
    dtype = q.dtype if k_scale is not None else k_cache.dtype

    def gather(cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:   # [B, padded, Hkv, D]
        gathered = cache.index_select(0, pages).view(batch, padded, num_kv_heads, head_dim)
        return gathered if kv_scale is None else dequantize_kv(gathered, kv_scale, dtype)

    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
    if layout.padding is None:
        k, v = k[:, :layout.max_len], v[:, :layout.max_len]
    else:
        k.masked_fill_(layout.padding, 0.0)
        v.masked_fill_(layout.padding, 0.0)
    qg = q.to(dtype).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), attn_mask=layout.mask,
                                         scale=scale)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)
