"""Causal attention of prefill chunks over paged KV (chunked prefill and prefix-cache hits).

Each sequence's new tokens are the last `q_len` of its `seq_lens[b]` context tokens, whose K/V
(cached prefix and new tokens alike) are already in the pages. One program owns a tile of
`BLOCK_M` rows, `PACK` query heads of one KV head times `BLOCK_M / PACK` consecutive tokens, and
walks the pages with an online softmax in two loops: the keys before the tile's first token, which
every row sees (no mask), then the few tiles on the diagonal (masked). Keys above the diagonal are
never visited. Programs of the heaviest (last) query tiles start first, and all heads of one tile
are launched together so the KV pages they share are read from L2. Where pages hold whole KV
tiles (`block_size` a multiple of `block_n`) on Hopper-class GPUs, the unmasked loop loads them
with TMA bulk copies.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.kv_quant import check_scales, is_fp8
from kernels.attention.prefix import PrefixSeed
from kernels.attention.splitkv import LOG2E, fp8_queries, head_scales, load_kv_tile, tma_tile
from kernels.attention.tma import tma_descriptors
from kernels.vendor import (
    WIDE_MIN_WAVES,
    PrefillConfig,
    check_launch_options,
    configs_for,
    interpreting,
    num_compute_units,
)

SEED_LOG2E = tl.constexpr(LOG2E)   # a seed's natural-log lse into the kernel's log2 units


@triton.jit
def _attend_keys(q, m, denom, acc, K, V, K_DESC, V_DESC, bt_row, lo, hi, hk, pos_m, score_scale,
                 stride_kb, stride_kt, stride_kh,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, NUM_STAGES: tl.constexpr,
                 UPCAST: tl.constexpr, CAUSAL_MASK: tl.constexpr, TMA: tl.constexpr):
    """Fold keys [lo, hi) into the online softmax (log2 units); CAUSAL_MASK for the diagonal.

    TMA (tiles within one page, unmasked loop only): each tile is one bulk copy of a page's rows
    through the caches' tensor descriptors [blocks * PAGE, Hkv * D]; the diagonal's masked tiles
    keep pointer loads, whose masked-off tokens read as 0 (unwritten slots may hold NaN)."""
    for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
        if TMA and not CAUSAL_MASK:
            k, v = tma_tile(K_DESC, V_DESC, bt_row, start, hk, PAGE, D, UPCAST)
            valid = tl.full([BLOCK_N], 1, tl.int1)
        else:
            k, v, valid = load_kv_tile(K, V, bt_row, start, hi, hk, stride_kb, stride_kt, stride_kh,
                                       PAGE, BLOCK_N, D, UPCAST)
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if CAUSAL_MASK:
            offs_n = start + tl.arange(0, BLOCK_N)
            visible = valid[None, :] & (offs_n[None, :] <= pos_m[:, None])
            s = tl.where(visible, s * score_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))     # key 0 is visible to every row: m is finite
            p = tl.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m, tl.max(s, 1) * score_scale)
            p = tl.exp2(s * score_scale - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m = m_new
    return m, denom, acc


@triton.jit
def _prefill_kernel(Q, K, V, K_DESC, V_DESC, BT, SEQ, QSL, OUT, K_SCALE, V_SCALE, SEED_OUT, SEED_LSE, KEY_START,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                    stride_ot, stride_oh, stride_lh, scale_log2,
                    GROUP: tl.constexpr, PACK: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
                    UPCAST: tl.constexpr, HAS_SCALE: tl.constexpr, TMA: tl.constexpr, HAS_SEED: tl.constexpr):
    TOKENS: tl.constexpr = BLOCK_M // PACK
    head0 = tl.program_id(0) * PACK
    tile = tl.num_programs(1) - 1 - tl.program_id(1)      # heaviest tiles first
    b = tl.program_id(2)
    q_start = tl.load(QSL + b)
    q_len = tl.load(QSL + b + 1) - q_start
    if tile * TOKENS < q_len:
        L = tl.load(SEQ + b)
        first_pos = L - q_len
        rows = tl.arange(0, BLOCK_M)
        offs_m = tile * TOKENS + rows // PACK
        heads = head0 + rows % PACK
        m_ok = offs_m < q_len
        pos_m = first_pos + offs_m
        d = tl.arange(0, D)
        tok = (q_start + offs_m).to(tl.int64)
        q = tl.load(Q + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=m_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        hk = head0 // GROUP
        k_scale, v_scale = head_scales(K_SCALE, V_SCALE, hk, HAS_SCALE)
        score_scale = scale_log2 * k_scale
        if HAS_SCALE:
            q = fp8_queries(q, score_scale, tl.float16, UPCAST)
            score_scale = 1.0
        bt_row = BT + b.to(tl.int64) * stride_bt
        tile_first = first_pos + tile * TOKENS
        hi = tl.minimum(L, tile_first + TOKENS)             # the tile's last row sees up to here
        lo = (tile_first // BLOCK_N) * BLOCK_N              # every row sees all keys before lo
        if HAS_SEED:   # keys [0, key_start) were attended outside: resume from their softmax state
            key_start = tl.load(KEY_START + b)
            lse = tl.load(SEED_LSE + heads * stride_lh + q_start + offs_m, mask=m_ok, other=float("-inf"))
            seeded = lse > float("-inf")
            m = tl.where(seeded, lse * SEED_LOG2E, float("-inf"))
            denom = tl.where(seeded, 1.0, 0.0)
            acc = tl.load(SEED_OUT + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                          mask=(m_ok & seeded)[:, None], other=0.0).to(tl.float32)
        else:
            key_start = 0
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            denom = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D], tl.float32)
        m, denom, acc = _attend_keys(q, m, denom, acc, K, V, K_DESC, V_DESC, bt_row, key_start, lo, hk, pos_m,
                                     score_scale, stride_kb, stride_kt, stride_kh, PAGE, BLOCK_N, D,
                                     NUM_STAGES, UPCAST, CAUSAL_MASK=False, TMA=TMA)
        m, denom, acc = _attend_keys(q, m, denom, acc, K, V, K_DESC, V_DESC, bt_row, lo, hi, hk, pos_m,
                                     score_scale, stride_kb, stride_kt, stride_kh, PAGE, BLOCK_N, D,
                                     NUM_STAGES, UPCAST, CAUSAL_MASK=True, TMA=TMA)
        out = acc * (v_scale / denom)[:, None]
        tl.store(OUT + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=m_ok[:, None])


def tile_rows(cfg: PrefillConfig, max_query_len: int, group: int) -> tuple[int, int]:
    """(query rows a tile, heads packed into them) of `cfg` for chunks of up to `max_query_len` tokens: short
    chunks take fewer rows a tile, and the group's heads fill them instead of padding."""
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(max_query_len * group)))
    return block_m, heads_per_tile(group, cfg.pack, block_m)


def launch_shape(cfg: PrefillConfig, max_query_len: int, num_heads: int, group: int, batch: int,
                 compute_units: int) -> PrefillConfig:
    """`cfg.wide` where its grid has at least `WIDE_MIN_WAVES` programs per compute unit, else `cfg`."""
    if cfg.wide is None:
        return cfg
    block_m, pack = tile_rows(cfg.wide, max_query_len, group)
    programs = num_heads // pack * triton.cdiv(max_query_len, block_m // pack) * batch
    return cfg.wide if programs >= WIDE_MIN_WAVES * compute_units else cfg


def heads_per_tile(group: int, max_pack: int, block_m: int) -> int:
    """The largest power of two dividing the GQA group, at most `max_pack` and `block_m`."""
    pack = 1
    while pack * 2 <= min(max_pack, block_m) and group % (pack * 2) == 0:
        pack *= 2
    return pack


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, *, scale: float, max_query_len: int | None = None,
                      config: PrefillConfig | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, seed: PrefixSeed | None = None) -> torch.Tensor:
    """q[T, Hq, D] (sequences back to back, `query_start_loc[B+1]`) -> out[T, Hq, D].

    Same contract as `kernels.attention.reference.prefill_attention_ref`. `max_query_len` sizes the grid;
    when omitted it is read from `query_start_loc` (one device sync). FP8 pages come with their
    per-head float32 `k_scale` / `v_scale` [Hkv]. `config` defaults to the vendor's for this head_dim.
    `seed` (`kernels.attention.prefix`): each sequence's keys before its `key_start` already attended,
    the kernel folds in the rest; key starts on the config's KV tiles.
    """
    check_scales(k_cache, k_scale, "prefill attention")
    check_scales(v_cache, v_scale, "prefill attention")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    if head_dim & (head_dim - 1) or head_dim < 16 or k_cache.stride() != v_cache.stride():
        raise ValueError("head_dim must be a power of two >= 16 and the caches must share strides")
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    group = num_heads // num_kv_heads
    cfg = config or configs_for(q.device).prefill_for(head_dim)
    if not is_fp8(k_cache.dtype):   # the wide shape was measured over pages of the model's dtype only
        cfg = launch_shape(cfg, max_query_len, num_heads, group, batch, num_compute_units(q.device))
    check_launch_options(cfg.extra, q.device)
    block_m, pack = tile_rows(cfg, max_query_len, group)
    tokens = block_m // pack
    grid = (num_heads // pack, triton.cdiv(max_query_len, tokens), batch)
    if seed is not None:
        check_seed(seed, q, batch, cfg.block_n)
    descriptors = tma_descriptors(k_cache, v_cache, cfg.block_n, cfg.tma)
    k_desc, v_desc = descriptors or (k_cache, v_cache)
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_desc, v_desc, block_tables, seq_lens, query_start_loc, out,
        seq_lens if k_scale is None else k_scale, seq_lens if v_scale is None else v_scale,
        out if seed is None else seed.out, seq_lens if seed is None else seed.lse,
        seq_lens if seed is None else seed.plan.key_start,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), 0 if seed is None else seed.lse.stride(0), scale * LOG2E,
        GROUP=group, PACK=pack, D=head_dim, PAGE=k_cache.shape[1], BLOCK_M=block_m,
        BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages, UPCAST=interpreting(), HAS_SCALE=is_fp8(k_cache.dtype),
        TMA=descriptors is not None, HAS_SEED=seed is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **cfg.extra)
    return out


def check_seed(seed: PrefixSeed, q: torch.Tensor, batch: int, block_n: int) -> None:
    """What the kernel assumes of a seed: rows and heads of `q`, one key start per sequence on a KV tile
    boundary (over FP8 pages, its `out` in units of V's codes: `prefix_seed` hands it so)."""
    if seed.out.shape != q.shape or seed.out.stride() != q.stride() or seed.lse.shape != (q.shape[1], q.shape[0]):
        raise ValueError(f"prefill attention: seed out {tuple(seed.out.shape)} / lse {tuple(seed.lse.shape)} "
                         f"do not match q {tuple(q.shape)}")
    starts = seed.plan.key_start_host
    if len(starts) != batch or any(start % block_n for start in starts):
        raise ValueError(f"prefill attention: seed key starts {starts} need one per sequence "
                         f"({batch}), each a multiple of the KV tile ({block_n})")
