"""Causal attention of prefill chunks over paged KV (chunked prefill and prefix-cache hits).

Each sequence's new tokens are the last `q_len` of its `seq_lens[b]` context tokens, whose K/V
(cached prefix and new tokens alike) are already in the pages. One program per (query tile,
sequence, query head) walks the pages up to the tile's causal limit with an online softmax, so
no page is gathered into a contiguous copy. Query heads of one KV head re-read that head's pages
(from L2 mostly); packing them into one tile as the decode kernels do is the next step.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.kv_quant import check_scales, is_fp8
from kernels.attention.splitkv import LOG2E, fp8_queries, head_scales, load_kv_tile
from kernels.vendor import PrefillConfig, check_launch_options, configs_for, interpreting


@triton.jit
def _prefill_kernel(Q, K, V, BT, SEQ, QSL, OUT, K_SCALE, V_SCALE,
                    stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                    stride_ot, stride_oh, scale_log2,
                    GROUP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr,
                    HAS_SCALE: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(QSL + b)
    q_len = tl.load(QSL + b + 1) - q_start
    if tile * BLOCK_M < q_len:
        L = tl.load(SEQ + b)
        first_pos = L - q_len
        offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        pos_m = first_pos + offs_m
        d = tl.arange(0, D)
        tok = (q_start + offs_m).to(tl.int64)
        q = tl.load(Q + tok[:, None] * stride_qt + h * stride_qh + d[None, :], mask=m_ok[:, None], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        hk = h // GROUP
        k_scale, v_scale = head_scales(K_SCALE, V_SCALE, hk, HAS_SCALE)
        score_scale = scale_log2 * k_scale
        if HAS_SCALE:
            q = fp8_queries(q, score_scale, tl.float16, UPCAST)
            score_scale = 1.0
        bt_row = BT + b.to(tl.int64) * stride_bt
        hi = tl.minimum(L, first_pos + (tile + 1) * BLOCK_M)     # the tile's last row sees up to here
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for start in tl.range(0, hi, BLOCK_N, num_stages=NUM_STAGES):
            k, v, valid = load_kv_tile(K, V, bt_row, start, hi, hk, stride_kb, stride_kt, stride_kh,
                                       PAGE, BLOCK_N, D, UPCAST)
            offs_n = start + tl.arange(0, BLOCK_N)
            visible = valid[None, :] & (offs_n[None, :] <= pos_m[:, None])
            s = tl.where(visible, tl.dot(q, tl.trans(k.to(q.dtype))) * score_scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))      # key 0 is visible to every row: m is finite
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            denom = denom * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
            m = m_new
        out = acc * (v_scale / denom)[:, None]
        tl.store(OUT + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=m_ok[:, None])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, *, scale: float, max_query_len: int | None = None,
                      config: PrefillConfig | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q[T, Hq, D] (sequences back to back, `query_start_loc[B+1]`) -> out[T, Hq, D].

    Same contract as `kernels.attention.reference.prefill_attention_ref`. `max_query_len` sizes the grid;
    when omitted it is read from `query_start_loc` (one device sync). FP8 pages come with their
    per-head float32 `k_scale` / `v_scale` [Hkv].
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
    cfg = config or configs_for(q.device).prefill
    check_launch_options(cfg.extra, q.device)
    block_m = min(cfg.block_m, max(16, triton.next_power_of_2(max_query_len)))
    block_n = cfg.block_n if head_dim <= 128 else min(cfg.block_n, 32)   # D=256: keep tiles in smem
    grid = (triton.cdiv(max_query_len, block_m), batch, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        seq_lens if k_scale is None else k_scale, seq_lens if v_scale is None else v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * LOG2E,
        GROUP=num_heads // num_kv_heads, D=head_dim, PAGE=k_cache.shape[1], BLOCK_M=block_m,
        BLOCK_N=block_n, NUM_STAGES=cfg.num_stages, UPCAST=interpreting(), HAS_SCALE=is_fp8(k_cache.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.extra)
    return out
