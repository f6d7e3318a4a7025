"""Paged attention tuned for the CPU: torch's fused kernels over gathered K/V, no per-page Python.

Same signatures and cache layout as `kernels.attention.reference` (its torch references stay the
oracle). Prefill runs `scaled_dot_product_attention` (CPU flash kernels) over each sequence's
gathered K/V; decode is one exact pass: short batches gathered once, long sequences read in place
(a run of consecutive pages in the NHD layout is a strided [tokens, Hkv, D] view). In prefill a
group's query heads see their KV head expanded, because SDPA's `enable_gqa` on the CPU is several
times slower than the expanded call. FP8 pages (`kernels.attention.kv_quant`) are dequantized
as they are read: a gather, or each run of pages converted once per layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention.kv_quant import dequantize_kv, store_rows
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
                 v_scale: torch.Tensor | None = None) -> None:
    """`reference.store_kv_ref` without its padding mask when no slot is padding (-1), as on the
    CPU's eager steps: two index copies instead of a mask, its nonzero and two masked gathers."""
    if slot_mapping.numel() == 0:
        return
    if int(slot_mapping.min()) < 0:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=k_scale, v_scale=v_scale)
        return
    slots = slot_mapping.long()
    store_rows(k_cache, slots, key, k_scale)
    store_rows(v_cache, slots, value, v_scale)


def prefill_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          query_start_loc: torch.Tensor, *, scale: float, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.prefill_attention_ref` through SDPA: q[T, Hq, D] of each sequence's new tokens
    (the last q_len of its seq_lens[b] tokens, whose K/V are in the pages) -> out[T, Hq, D]."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    starts = query_start_loc.tolist()
    for b, context_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        k = _heads_first(gather_kv_ref(k_cache, block_tables[b], context_len, k_scale, q.dtype), group)
        v = _heads_first(gather_kv_ref(v_cache, block_tables[b], context_len, v_scale, q.dtype), group)
        qh = q[q_start:q_end].transpose(0, 1)[None]     # 4-D: SDPA's CPU flash kernel takes no 3-D input
        if q_len == context_len:
            o = F.scaled_dot_product_attention(qh, k[None], v[None], is_causal=True, scale=scale)
        else:   # a cached prefix: the causal diagonal sits at the bottom right
            q_pos = torch.arange(context_len - q_len, context_len, device=q.device)
            mask = torch.arange(context_len, device=q.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(qh, k[None], v[None], attn_mask=mask, scale=scale)
        out[q_start:q_end] = o[0].transpose(0, 1)
    return out


# A padded gather of the whole batch is cheaper than a Python loop over sequences while the batch's
# pages are short; past this many tokens each sequence reads its pages in place (no copy).
GATHER_MAX_LEN = 1024
# A lone sequence is gathered up to this length (one SDPA call instead of one per run of pages): decode at
# 100 tokens of context 19.4 against 20.3 ms a token, even at 500, 1.04x slower at 1,000 (embedded default,
# 2-core AVX512/AMX CPU).
GATHER_MAX_LEN_ONE = 512
# Half-precision pages of at least this many tokens are multiplied as they are, one KV head at a
# time; shorter ones are converted to float32 first, where the fixed cost of a bf16 matmul of a few
# query rows (~40 us) outweighs the conversion.
NATIVE_HALF_MIN_LEN = 2048
# A sequence of up to this many tokens is attended by SDPA's CPU flash kernel; longer half-precision
# pages by `_attend_half` (on a 2-core AVX512/AMX CPU, 30 layers of bf16 pages: 0.18 against
# 0.36 ms a layer at 2,048 tokens, 0.50 against 0.53 at 4,096, 0.80 against 0.70 at 5,700).
SDPA_MAX_LEN = 4096
# A block table in more pieces than this is gathered instead (each piece costs two matmuls).
MAX_PAGE_RUNS = 16


@dataclass(frozen=True)
class PageRun:
    """Consecutive pages [first_block, first_block + num_blocks) holding `num_tokens` tokens."""

    first_block: int
    num_blocks: int
    num_tokens: int


def page_runs(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> list[list[PageRun]]:
    """Each sequence's pages as runs of consecutive block ids (the block manager hands out blocks in
    order, so a sequence is usually one run): the views that `decode_attention_cpu` reads in place."""
    runs: list[list[PageRun]] = []
    for b, length in enumerate(seq_lens.tolist()):
        num_pages = (length + block_size - 1) // block_size
        if num_pages == 0:
            runs.append([])
            continue
        table = block_tables[b, :num_pages].long()
        breaks = ((table[1:] - table[:-1]) != 1).nonzero().flatten().add_(1).tolist()
        starts = [0, *breaks]
        ends = [*breaks, num_pages]
        first_blocks = table[starts].tolist()
        runs.append([PageRun(first, end - start, min(end * block_size, length) - start * block_size)
                     for first, start, end in zip(first_blocks, starts, ends, strict=True)])
    return runs


def reads_in_place(batch: int, max_len: int) -> bool:
    """Whether `decode_attention_cpu` reads this step's pages in place (and so uses `page_runs`)."""
    return max_len > (GATHER_MAX_LEN_ONE if batch == 1 else GATHER_MAX_LEN)


def decode_attention_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                         runs: list[list[PageRun]] | None = None, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.decode_attention_ref` without per-page Python: q[B, Hq, D] -> [B, Hq, D].

    A batch whose sequences are all short is gathered and padded once (two batched matmuls);
    otherwise each sequence multiplies its pages where they lie, one matmul per run of consecutive
    pages (`runs`, from `page_runs`: computed here when not given, or once per step by the caller).
    Scores and softmax are float32 (or float64 for float64 inputs)."""
    batch = q.shape[0]
    max_len = int(seq_lens.max().item()) if batch else 0
    if max_len == 0:
        return torch.zeros_like(q)
    if not reads_in_place(batch, max_len):
        return _decode_gathered(q, k_cache, v_cache, block_tables, seq_lens, scale, max_len, k_scale, v_scale)
    if runs is None:
        runs = page_runs(block_tables, seq_lens, k_cache.shape[1])
    out = torch.empty_like(q)
    for b, seq_runs in enumerate(runs):
        if not seq_runs:
            out[b].zero_()
            continue
        if len(seq_runs) > MAX_PAGE_RUNS:
            length = sum(run.num_tokens for run in seq_runs)
            keys = [gather_kv_ref(k_cache, block_tables[b], length)]
            values = [gather_kv_ref(v_cache, block_tables[b], length)]
        else:
            keys = [_run_view(k_cache, run) for run in seq_runs]
            values = [_run_view(v_cache, run) for run in seq_runs]
        if k_scale is not None:   # FP8 codes: converted once, the scale folded in
            keys = [dequantize_kv(k, k_scale) for k in keys]
        if v_scale is not None:
            values = [dequantize_kv(v, v_scale) for v in values]
        out[b] = _attend_one(q[b], keys, values, scale)
    return out


def _run_view(cache: torch.Tensor, run: PageRun) -> torch.Tensor:
    """The run's tokens as a [num_tokens, Hkv, D] view of the pages (no copy)."""
    pages = cache[run.first_block:run.first_block + run.num_blocks]
    return pages.view(-1, *cache.shape[2:])[:run.num_tokens]


def _attend_one(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                scale: float) -> torch.Tensor:
    """One query token q[Hq, D] over its KV in pieces ([n_i, Hkv, D] each) -> [Hq, D] in q's dtype."""
    length = sum(k.shape[0] for k in keys)
    if length <= SDPA_MAX_LEN:
        return _attend_sdpa(q, keys, values, scale)
    num_kv_heads, head_dim = keys[0].shape[1], keys[0].shape[2]
    group = q.shape[0] // num_kv_heads
    compute = torch.promote_types(q.dtype, torch.float32)
    native = keys[0].dtype == compute or length >= NATIVE_HALF_MIN_LEN
    if not native:
        keys = [k.to(compute) for k in keys]
        values = [v.to(compute) for v in values]
    if keys[0].dtype != compute:
        return _attend_half(q, keys, values, scale, group)
    qg = q.view(num_kv_heads, group, head_dim).to(compute)
    # one batched matmul over the KV heads of each piece
    scores = torch.cat([torch.matmul(qg, k.permute(1, 2, 0)) for k in keys], dim=-1)
    probs = torch.softmax(scores.mul_(scale), dim=-1)   # [Hkv, G, length]
    out = torch.zeros(num_kv_heads, group, head_dim, dtype=compute, device=q.device)
    offset = 0
    for v in values:
        out += torch.matmul(probs[..., offset:offset + v.shape[0]], v.permute(1, 0, 2))
        offset += v.shape[0]
    return out.view(-1, head_dim).to(q.dtype)


def _attend_sdpa(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """One query token q[Hq, D] over its KV in pieces (strided [n_i, Hkv, D] views of the pages) through
    SDPA's CPU flash kernel, a group's query heads as the rows of its KV head: one call per piece, float32
    softmax and accumulation, pieces merged by their log-sum-exps. On a 2-core AVX512 CPU one piece of
    100 tokens takes 18 us (four products and a softmax: 78 us), of 2,048 bf16 tokens 0.18 against
    `_attend_half`'s 0.36 ms (`SDPA_MAX_LEN`)."""
    num_kv_heads, head_dim = keys[0].shape[1], keys[0].shape[2]
    dtype = keys[0].dtype
    qg = q.to(dtype).view(1, num_kv_heads, -1, head_dim)
    if len(keys) == 1:
        out = F.scaled_dot_product_attention(qg, keys[0].permute(1, 0, 2)[None], values[0].permute(1, 0, 2)[None],
                                             scale=scale)
        return out.reshape(q.shape).to(q.dtype)
    parts = [torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qg, k.permute(1, 0, 2)[None], v.permute(1, 0, 2)[None], scale=scale) for k, v in zip(keys, values, strict=True)]
    weights = torch.softmax(torch.stack([lse for _, lse in parts]), dim=0)   # [pieces, 1, Hkv, G]
    out = sum(w[..., None] * piece.float() for w, (piece, _) in zip(weights, parts, strict=True))
    return out.reshape(q.shape).to(q.dtype)


def _attend_half(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float,
                 group: int) -> torch.Tensor:
    """`_attend_one` on half-precision pages in place: every query head against every KV head of a
    piece in one contiguous GEMM ([Hq, D] x [n * Hkv, D]ᵀ, then [Hq, n] x [n, Hkv * D]) and each
    head's own KV head taken from the result. That multiplies Hkv times the needed flops but reads
    each piece once, contiguously; per-head products over the strided [n, D] slices cost 1.25x as
    much on a 2-core AVX512/AMX CPU at 6K tokens."""
    num_kv_heads, head_dim = keys[0].shape[1], keys[0].shape[2]
    num_heads = q.shape[0]
    qh = q.to(keys[0].dtype)
    scores = torch.cat([torch.diagonal((qh @ k.reshape(-1, head_dim).t()).view(num_kv_heads, group, -1, num_kv_heads),
                                       dim1=0, dim2=3) for k in keys], dim=1)   # [G, length, Hkv]
    probs = torch.softmax(scores.permute(2, 0, 1).float().mul_(scale), dim=-1)   # [Hkv, G, length]
    out = torch.zeros(num_kv_heads, group, head_dim, dtype=torch.float32, device=q.device)
    offset = 0
    for v in values:
        p = probs[..., offset:offset + v.shape[0]].reshape(num_heads, -1).to(v.dtype)
        offset += v.shape[0]
        both = (p @ v.reshape(v.shape[0], -1)).view(num_kv_heads, group, num_kv_heads, head_dim)
        out += torch.diagonal(both, dim1=0, dim2=2).permute(2, 0, 1).float()
    return out.view(-1, head_dim).to(q.dtype)


def _decode_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, max_len: int, k_scale: torch.Tensor | None,
                     v_scale: torch.Tensor | None) -> torch.Tensor:
    """The batch's pages gathered into one padded [B, padded, Hkv, D] per cache, attended by one SDPA
    call (a group's query heads as the rows of its KV head); one sequence is cut to its length, a
    batch's padding is masked and zeroed (stale pages may hold NaN, and 0 * NaN = NaN)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_pages = (max_len + block_size - 1) // block_size
    padded = num_pages * block_size
    pages = block_tables[:, :num_pages].long()
    dtype = q.dtype if k_scale is not None else k_cache.dtype

    def gather(cache: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:   # [B, padded, Hkv, D]
        gathered = cache[pages].view(batch, padded, num_kv_heads, head_dim)
        return gathered if kv_scale is None else dequantize_kv(gathered, kv_scale, dtype)

    k, v = gather(k_cache, k_scale), gather(v_cache, v_scale)
    mask = None
    if batch == 1:
        k, v = k[:, :max_len], v[:, :max_len]
    else:
        visible = torch.arange(padded, device=q.device)[None, :] < seq_lens[:, None].to(q.device)   # [B, padded]
        k.masked_fill_(~visible[:, :, None, None], 0.0)
        v.masked_fill_(~visible[:, :, None, None], 0.0)
        mask = visible[:, None, None, :]
    qg = q.to(dtype).view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(qg, k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), attn_mask=mask,
                                         scale=scale)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)
