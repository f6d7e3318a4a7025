"""Faster Flash Decoding for prefill chunks in Triton: every query follows the rule of
`kernels/ffd/reference.py` (its docstring is the specification), as `kernels/ffd/decode.py` does for the
one query of a decode step, with the same arithmetic (the shared helpers), so a prompt prefilled
here, in chunks or after a prefix-cache hit, attends as decode steps over the same tokens would.

One program per (query tile, sequence, KV head). Its rows are BLOCK_M consecutive queries times
the GQA group's query heads (padded to a power of two, GP): row r is query r // GP, head r % GP,
so the group's keep decision (a block is kept for a query when any head of its group passes) is
a max over GP neighbouring rows. Two passes over the pages, nothing written in between:
  1. pseudo-max: the sink pages and the pages of the tile's local windows; per row, the max score
     over its sink and window tokens (refined keys in the row's full blocks, exact in its tail).
  2. attend: every page up to the tile's last query. For one row a page is quantized (a full block
     of its context: 2-bit scan, refined scores if kept), its exact tail (causal), or past it.
     The refined dots, the exact dot and P.V run only when some row of the tile needs them.
Prefill does BLOCK_M times the arithmetic of a decode per byte read, so the loop branches per
page (whole-tile decisions), and a kept block's refined scores are the selection's 2-bit scores
(q * s rounded to bf16 once) plus the residual dots, where the decode splits the work into a pure
scan and an attend over the kept blocks. Softmax scores thus have the precision of bf16 keys, as
the decode's attend (`kernels/ffd/tiles.py`, `_refined_dots`); the threshold is the fp32-exact form.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.kv_store import key_page
from kernels.ffd.decode import LOG2E, check_ffd_inputs
from kernels.ffd.reference import FFDParams
from kernels.ffd.tiles import (
    _code_dots,
    _load_codes,
    _load_residual,
    _load_scales,
    _page_tile,
    _quant_scores,
    _res_dots,
)
from kernels.vendor import interpreting

TILE_ROWS = 64           # query rows (queries x padded group) of one program; 32 at head_dim 256
PREFILL_WARPS = 4        # 4 warps x 64 rows beat 8 warps in the H200 sweep (bench/RESULTS.md)


@triton.jit
def _online_masked(m, denom, acc, z, v):
    """One online-softmax step (base 2) where a row may have seen no visible token yet (m = -inf
    and z all -inf): it stays empty instead of turning into NaN."""
    m_new = tl.maximum(m, tl.max(z, 1))
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m - m_ref)
    p = tl.exp2(z - m_ref[:, None])
    return m_new, denom * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _load_q_rows(Q, tok, head, row_ok, stride_qt, stride_qh, D: tl.constexpr, D4: tl.constexpr,
                 UPCAST: tl.constexpr):
    """q rows [ROWS, D] and their four channel planes [ROWS, D/4] (padding rows read 0)."""
    base = Q + tok[:, None] * stride_qt + head[:, None] * stride_qh
    cols = tl.arange(0, D4)[None, :]
    q = tl.load(base + tl.arange(0, D)[None, :], mask=row_ok[:, None], other=0.0)
    q0 = tl.load(base + 0 * D4 + cols, mask=row_ok[:, None], other=0.0)
    q1 = tl.load(base + 1 * D4 + cols, mask=row_ok[:, None], other=0.0)
    q2 = tl.load(base + 2 * D4 + cols, mask=row_ok[:, None], other=0.0)
    q3 = tl.load(base + 3 * D4 + cols, mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q, q0, q1, q2, q3 = q.to(tl.float32), q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32), \
            q3.to(tl.float32)
    return q, q0, q1, q2, q3


@triton.jit
def _page_scores(q, q0, q1, q2, q3, K, KMAP, CODES, SCALES, RES, page, blk, hk, L, pos, nq, any_quant, any_exact,
                 stride_kb, stride_kt, stride_kh, scale_log2, NUM_KV_HEADS: tl.constexpr, ROWS: tl.constexpr,
                 BS: tl.constexpr, D: tl.constexpr, D4: tl.constexpr, UPCAST: tl.constexpr, HAS_KMAP: tl.constexpr):
    """Scores [ROWS, BS] (log2 units) of page `blk` for every row: refined keys where the block is
    one of the row's full blocks (blk < nq), exact keys where it holds the row's tail, -inf past
    the row's position. `any_quant` / `any_exact`: whether some row needs that kind at all."""
    toks = blk * BS + tl.arange(0, BS)
    z = tl.full([ROWS, BS], float("-inf"), tl.float32)
    if any_quant:
        zq = _quant_scores(q0, q1, q2, q3, CODES, SCALES, RES, page, hk, 0, NUM_KV_HEADS, ROWS, BS, 1, D, D4,
                           True, UPCAST) * scale_log2
        z = tl.where((blk < nq)[:, None], zq, z)
    if any_exact:
        k = _page_tile(K, key_page(KMAP, page, HAS_KMAP), hk, stride_kb, stride_kt, stride_kh, toks < L, BS, D, UPCAST)
        ze = tl.dot(q, tl.trans(k)) * scale_log2
        z = tl.where((blk >= nq)[:, None] & (toks[None, :] <= pos[:, None]), ze, z)
    return z


@triton.jit
def _window_max(best, z, blk, pos, sink, window, BS: tl.constexpr):
    """best = max(best, row max of z over the sink and local-window tokens of each row)."""
    toks = blk * BS + tl.arange(0, BS)
    in_window = (toks[None, :] < sink) | (toks[None, :] > pos[:, None] - window)
    return tl.maximum(best, tl.max(tl.where(in_window, z, float("-inf")), 1))


@triton.jit
def _group_any(x, BLOCK_M: tl.constexpr, GP: tl.constexpr):
    """x[ROWS] int32 0/1 -> 1 on every row whose query has some head (of GP rows) with 1."""
    per_query = tl.max(tl.reshape(x, (BLOCK_M, GP)), 1)
    return tl.reshape(tl.broadcast_to(per_query[:, None], (BLOCK_M, GP)), (BLOCK_M * GP,))


@triton.jit
def _ffd_prefill_kernel(Q, K, V, KMAP, CODES, SCALES, RES, BT, SEQ, QSL, OUT,
                        stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_ot, stride_oh,
                        scale_log2, delta_log2, sink, window, min_ffd_len,
                        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                        BLOCK_M: tl.constexpr, D: tl.constexpr, D4: tl.constexpr, BS: tl.constexpr,
                        UPCAST: tl.constexpr, HAS_KMAP: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    hk = tl.program_id(2)
    q_start = tl.load(QSL + b)
    q_len = tl.load(QSL + b + 1) - q_start
    if tile * BLOCK_M < q_len:
        ROWS: tl.constexpr = BLOCK_M * GP
        L = tl.load(SEQ + b)
        r = tl.arange(0, ROWS)
        g = r % GP
        i = tile * BLOCK_M + r // GP
        row_ok = (g < GROUP) & (i < q_len)
        # rows past the chunk repeat its last query: finite everywhere, never stored, never voting
        pos = L - q_len + tl.minimum(i, q_len - 1)
        nq = tl.where(pos + 1 < min_ffd_len, 0, (pos + 1) // BS)   # "auto" rows below the crossover: dense
        q, q0, q1, q2, q3 = _load_q_rows(Q, (q_start + i).to(tl.int64), hk * GROUP + g, row_ok,
                                         stride_qt, stride_qh, D, D4, UPCAST)
        bt_row = BT + b.to(tl.int64) * stride_bt
        p_lo = tl.min(pos, 0)
        last_page = tl.max(pos, 0) // BS
        nq_lo = tl.min(nq, 0)
        nq_hi = tl.max(nq, 0)

        # pass 1: pseudo-max over the sinks and the local windows
        best = tl.full([ROWS], float("-inf"), tl.float32)
        sink_pages = tl.cdiv(sink, BS)
        for blk in range(tl.minimum(sink_pages, last_page + 1)):
            page = tl.load(bt_row + blk).to(tl.int64)
            z = _page_scores(q, q0, q1, q2, q3, K, KMAP, CODES, SCALES, RES, page, blk, hk, L, pos, nq, blk < nq_hi,
                             blk >= nq_lo, stride_kb, stride_kt, stride_kh, scale_log2, NUM_KV_HEADS, ROWS, BS,
                             D, D4, UPCAST, HAS_KMAP)
            best = _window_max(best, z, blk, pos, sink, window, BS)
        for blk in range(tl.maximum(tl.maximum(p_lo + 1 - window, 0) // BS, sink_pages), last_page + 1):
            page = tl.load(bt_row + blk).to(tl.int64)
            z = _page_scores(q, q0, q1, q2, q3, K, KMAP, CODES, SCALES, RES, page, blk, hk, L, pos, nq, blk < nq_hi,
                             blk >= nq_lo, stride_kb, stride_kt, stride_kh, scale_log2, NUM_KV_HEADS, ROWS, BS,
                             D, D4, UPCAST, HAS_KMAP)
            best = _window_max(best, z, blk, pos, sink, window, BS)
        th = best - delta_log2

        # pass 2: attend
        m = tl.full([ROWS], float("-inf"), tl.float32)
        denom = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)
        for blk in range(last_page + 1):
            page = tl.load(bt_row + blk).to(tl.int64)
            toks = blk * BS + tl.arange(0, BS)
            quant = blk < nq
            z = tl.full([ROWS, BS], float("-inf"), tl.float32)
            if blk < nq_hi:
                qbase = page * NUM_KV_HEADS + hk
                s0, s1, s2, s3 = _load_scales(SCALES, qbase, D, D4)
                byte = _load_codes(CODES, qbase, BS, D4)
                # the decode scan's selection arithmetic (q * s rounded once), then its forced blocks
                sel = _code_dots(q0, q1, q2, q3, s0, s1, s2, s3, byte, ROWS, BS, False, UPCAST)
                bmax = tl.max(sel, 1)
                hit = _group_any((row_ok & quant & (bmax * scale_log2 >= th)).to(tl.int32), BLOCK_M, GP)
                forced = (blk < sink_pages) | ((blk + 1) * BS > pos + 1 - window)
                keep = ((hit > 0) | forced) & quant
                if tl.max(keep.to(tl.int32), 0) > 0:
                    r0, r1, r2, r3 = _load_residual(RES, qbase, BS, D, D4)
                    raw = _res_dots(sel, q0, q1, q2, q3, s0, s1, s2, s3, r0, r1, r2, r3, UPCAST)
                    z = tl.where(keep[:, None], raw * scale_log2, z)
            # `_page_scores`' exact part, inline and after the quantized branch: computed first, its
            # scores live longer and the loop runs slower
            if blk >= nq_lo:
                k = _page_tile(K, key_page(KMAP, page, HAS_KMAP), hk, stride_kb, stride_kt, stride_kh, toks < L,
                               BS, D, UPCAST)
                ze = tl.dot(q, tl.trans(k)) * scale_log2
                z = tl.where((~quant)[:, None] & (toks[None, :] <= pos[:, None]), ze, z)
            if tl.max(tl.max(z, 1), 0) > float("-inf"):
                v = _page_tile(V, page, hk, stride_kb, stride_kt, stride_kh, toks < L, BS, D, UPCAST)
                m, denom, acc = _online_masked(m, denom, acc, z, v)
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tok = (q_start + i).to(tl.int64)
        tl.store(OUT + tok[:, None] * stride_ot + (hk * GROUP + g)[:, None] * stride_oh + tl.arange(0, D)[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def prefill_tile(group: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M queries, GP padded group) of one program: about TILE_ROWS rows, at least 16."""
    gp = triton.next_power_of_2(group)
    rows = TILE_ROWS if head_dim <= 128 else TILE_ROWS // 2
    return max(1, rows // gp, 16 // gp), gp


def ffd_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, codes: torch.Tensor,
                scales: torch.Tensor, residual: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, *, scale: float, params: FFDParams,
                max_query_len: int | None = None, key_page_map: torch.Tensor | None = None) -> torch.Tensor:
    """q[T, Hq, D] (each sequence's new tokens, the last q_len of its seq_lens[b], back to back by
    `query_start_loc[B+1]`; their K/V stored and full pages quantized) -> out[T, Hq, D] under the
    FFD rule. Same contract as `kernels.ffd.reference.ffd_prefill_ref` (`key_page_map`: see
    `kernels.ffd.decode.ffd_decode`). `max_query_len` sizes the grid; when omitted it is read from
    `query_start_loc` (one device sync)."""
    num_tokens, num_heads, dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    batch = seq_lens.shape[0]
    check_ffd_inputs("FFD prefill", q, k_cache, v_cache, block_tables, seq_lens, params)
    if num_tokens == 0 or batch == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max().item())
    group = num_heads // kv_heads
    block_m, gp = prefill_tile(group, dim)
    grid = (triton.cdiv(max_query_len, block_m), batch, kv_heads)
    _ffd_prefill_kernel[grid](
        q, k_cache, v_cache, seq_lens if key_page_map is None else key_page_map, codes, scales, residual,
        block_tables, seq_lens, query_start_loc, out,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), scale * LOG2E, min(params.delta_log2, 1e30), params.sink_tokens,
        params.local_window, params.min_ffd_len,
        NUM_KV_HEADS=kv_heads, GROUP=group, GP=gp, BLOCK_M=block_m, D=dim, D4=dim // 4, BS=bs,
        UPCAST=interpreting(), HAS_KMAP=key_page_map is not None, num_warps=PREFILL_WARPS)
    return out
