"""Triton device pieces shared by the paged decode kernels (flash, fdpp) and the prefill's tile loader.

A program owns the `G = Hq / Hkv` query heads of one KV head as the rows of one tile (padded to 16,
the `tl.dot` minimum) and walks its split of one sequence's pages with `attend`; `split_plan` derives
that split from `seq_lens` on the device, so the host picks only the split count.

FP8 pages (`kernels.attention.kv_quant`) are converted to the query rows' dtype as they are
multiplied, and the rows are pre-multiplied by the score scale (`fp8_queries`). Flash-Decoding and
prefill take fp16 rows, since the codes convert to fp16 in one instruction per pair and their P is
at most 1; FD++ keeps bf16 rows, whose P = 2^(s - φ) needs bf16's range (`safe_window`). The KV
head's scales never touch a tile: K's folds into the score scale, V's into the output.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def split_plan(L, max_splits, min_chunk, BLOCK_N: tl.constexpr):
    """(chunk, num_splits) of one sequence; mirrors `kernels.attention.reference.split_plan`."""
    chunk = tl.cdiv(tl.cdiv(L, max_splits), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, min_chunk)           # host rounds min_chunk to a multiple of BLOCK_N
    return chunk, tl.maximum(tl.cdiv(L, chunk), 1)


@triton.jit
def kv_token_offsets(bt_row, start, hi, offs, valid, stride_kb, stride_kt,
                     PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 element offsets of tokens `offs` (the tile starting at `start`) in the paged cache."""
    if PAGE >= BLOCK_N:
        # Powers of two and BLOCK_N-aligned tiles: the tile sits in one page, one table read.
        page = tl.load(bt_row + start // PAGE, mask=start < hi, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + offs // PAGE, mask=valid, other=0).to(tl.int64)
    return page * stride_kb + (offs % PAGE).to(tl.int64) * stride_kt


@triton.jit
def tile_tokens(bt_row, start, hi, hk, stride_kb, stride_kt, stride_kh,
                PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets of head `hk` of tokens [start, start + BLOCK_N) and the mask of those < hi."""
    offs = start + tl.arange(0, BLOCK_N)
    valid = offs < hi
    tok = kv_token_offsets(bt_row, start, hi, offs, valid, stride_kb, stride_kt, PAGE, BLOCK_N)
    return tok + hk * stride_kh, valid


@triton.jit
def load_tile(K, V, tok, valid, D: tl.constexpr, UPCAST: tl.constexpr):
    """K and V [BLOCK_N, D]. Masked tokens read as 0: unwritten cache memory may hold NaN bit
    patterns, and 0·NaN = NaN in P·V."""
    ptr = tok[:, None] + tl.arange(0, D)[None, :]
    k = tl.load(K + ptr, mask=valid[:, None], other=0.0)
    v = tl.load(V + ptr, mask=valid[:, None], other=0.0)
    if UPCAST:   # the interpreter mis-computes bf16 arithmetic
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def load_kv_tile(K, V, bt_row, start, hi, hk, stride_kb, stride_kt, stride_kh,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr):
    tok, valid = tile_tokens(bt_row, start, hi, hk, stride_kb, stride_kt, stride_kh, PAGE, BLOCK_N)
    k, v = load_tile(K, V, tok, valid, D, UPCAST)
    return k, v, valid


@triton.jit
def head_scales(K_SCALE, V_SCALE, hk, HAS_SCALE: tl.constexpr):
    """(K scale, V scale) of KV head `hk` for FP8 pages; (1, 1) otherwise."""
    if HAS_SCALE:
        return tl.load(K_SCALE + hk), tl.load(V_SCALE + hk)
    return 1.0, 1.0


@triton.jit
def fp8_queries(q, score_scale, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """Query rows for FP8 pages: times the score scale (the scores come out in log2 units), in DTYPE."""
    q = q.to(tl.float32) * score_scale
    if not UPCAST:
        q = q.to(DTYPE)
    return q


@triton.jit
def load_q_rows(Q, b, hk, stride_qb, stride_qh, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                D: tl.constexpr, UPCAST: tl.constexpr):
    """The G query heads of KV head `hk` as rows [BLOCK_H, D] (padding rows are zero)."""
    rows = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    heads = hk * GROUP + rows
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=(rows < GROUP)[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def softmax_step(q, k, v, valid, m, denom, acc, phi, scale_log2, ASYNC: tl.constexpr):
    """Fold one KV tile into (m, denom, acc), log2 units.

    Exact: online softmax, rescaling denom and acc whenever the running max m grows.
    ASYNC (FD++): exponentiate against the unified max φ; no rescale. m is then only the true
    row max, kept (one reduction, no exponential) for the range check.
    """
    s = tl.where(valid[None, :], tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2, float("-inf"))
    if ASYNC:
        m = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - phi[:, None])
        denom += tl.sum(p, 1)
        acc += tl.dot(p.to(q.dtype), v.to(q.dtype))
    else:
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
        m = m_new
    return m, denom, acc


@triton.jit
def tma_tile(K_DESC, V_DESC, bt_row, start, hk, PAGE: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr):
    """K and V [BLOCK_N, D] of the whole tile at `start` (within one page), one TMA copy each through the
    caches' descriptors [blocks * PAGE, Hkv * D] (`kernels.attention.tma`)."""
    row = tl.load(bt_row + start // PAGE) * PAGE + start % PAGE
    k = K_DESC.load([row, hk * D])
    v = V_DESC.load([row, hk * D])
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def window_tokens(PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_WINDOW: tl.constexpr):
    """Tokens per page window: BLOCK_N-aligned windows touch at most PAGE_WINDOW pages."""
    if PAGE <= BLOCK_N:
        return PAGE_WINDOW * PAGE
    else:
        return (PAGE_WINDOW - 1) * PAGE


@triton.jit
def attend(q, K, V, bt_row, lo, hi, hk, stride_kb, stride_kt, stride_kh, scale_log2, phi,
           ASYNC: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
           D: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, UPCAST: tl.constexpr,
           PAGE_WINDOW: tl.constexpr):
    """(m, denom, acc) of the rows `q` over tokens [lo, hi) (see `softmax_step`). Three loops:

    default: the page id is read inside the tile loop. Triton's pipeliner then keeps a single
        K/V buffer and waits for each tile; several resident CTAs per SM hide the latency, and
        on the H200 this is the fastest of the three (bench/RESULTS.md).
    PAGE_WINDOW: page ids of a window of pages are loaded into registers first, so the tile
        loop is pipelined with real multi-buffering; the buffers cost occupancy.
    PREFETCH: the next tile's K/V (and the page ids of the one after) are loaded in registers
        one iteration early; for targets where num_stages = 1 leaves no Triton pipelining.
    """
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    if PAGE_WINDOW > 0:
        # One page-table load per window: the tile loop then holds no load that feeds another
        # load's address, and Triton pipelines the K/V copies (TTGIR async_wait num=2, not 0).
        pidx = tl.arange(0, PAGE_WINDOW)
        for w_lo in range(lo, hi, window_tokens(PAGE, BLOCK_N, PAGE_WINDOW)):
            w_hi = tl.minimum(w_lo + window_tokens(PAGE, BLOCK_N, PAGE_WINDOW), hi)
            first = w_lo // PAGE
            pages = tl.load(bt_row + first + pidx, mask=(first + pidx) * PAGE < w_hi, other=0).to(tl.int64)
            for start in tl.range(w_lo, w_hi, BLOCK_N, num_stages=NUM_STAGES):
                offs = start + tl.arange(0, BLOCK_N)
                valid = offs < w_hi
                if PAGE >= BLOCK_N:
                    page = tl.sum(tl.where(pidx == start // PAGE - first, pages, 0), 0)
                    tok = page * stride_kb
                else:
                    NPT: tl.constexpr = BLOCK_N // PAGE
                    j = (start // PAGE - first) + tl.arange(0, NPT)
                    tile_pages = tl.sum(tl.where(pidx[None, :] == j[:, None], pages[None, :], 0), 1)
                    tok = tl.reshape(tl.broadcast_to(tile_pages[:, None], [NPT, PAGE]), [BLOCK_N]) * stride_kb
                tok += (offs % PAGE).to(tl.int64) * stride_kt + hk * stride_kh
                k, v = load_tile(K, V, tok, valid, D, UPCAST)
                m, denom, acc = softmax_step(q, k, v, valid, m, denom, acc, phi, scale_log2, ASYNC)
    elif PREFETCH:
        tok, valid = tile_tokens(bt_row, lo, hi, hk, stride_kb, stride_kt, stride_kh, PAGE, BLOCK_N)
        k, v = load_tile(K, V, tok, valid, D, UPCAST)
        tok_n, valid_n = tile_tokens(bt_row, lo + BLOCK_N, hi, hk, stride_kb, stride_kt, stride_kh,
                                     PAGE, BLOCK_N)
        for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            k_n, v_n = load_tile(K, V, tok_n, valid_n, D, UPCAST)
            tok_nn, valid_nn = tile_tokens(bt_row, start + 2 * BLOCK_N, hi, hk, stride_kb, stride_kt,
                                           stride_kh, PAGE, BLOCK_N)
            m, denom, acc = softmax_step(q, k, v, valid, m, denom, acc, phi, scale_log2, ASYNC)
            k = k_n
            v = v_n
            valid = valid_n
            tok_n = tok_nn
            valid_n = valid_nn
    else:
        for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            k, v, valid = load_kv_tile(K, V, bt_row, start, hi, hk, stride_kb, stride_kt, stride_kh,
                                       PAGE, BLOCK_N, D, UPCAST)
            m, denom, acc = softmax_step(q, k, v, valid, m, denom, acc, phi, scale_log2, ASYNC)
    return m, denom, acc


@triton.jit
def attend_tma(q, K, V, K_DESC, V_DESC, bt_row, lo, hi, hk, stride_kb, stride_kt, stride_kh, scale_log2, phi,
               ASYNC: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
               D: tl.constexpr, NUM_STAGES: tl.constexpr, UPCAST: tl.constexpr):
    """`attend` with every whole tile one TMA bulk copy of a page's rows through the caches' descriptors
    [blocks * PAGE, Hkv * D] (PAGE a multiple of BLOCK_N, `lo` on a tile): the copies go straight to shared
    memory and NUM_STAGES of them are in flight. A last partial tile takes masked pointer loads, whose
    tokens past `hi` read as 0 (unwritten slots may hold NaN)."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    whole = lo + (hi - lo) // BLOCK_N * BLOCK_N
    every = tl.full([BLOCK_N], 1, tl.int1)
    for start in tl.range(lo, whole, BLOCK_N, num_stages=NUM_STAGES):
        k, v = tma_tile(K_DESC, V_DESC, bt_row, start, hk, PAGE, D, UPCAST)
        m, denom, acc = softmax_step(q, k, v, every, m, denom, acc, phi, scale_log2, ASYNC)
    if whole < hi:
        k, v, valid = load_kv_tile(K, V, bt_row, whole, hi, hk, stride_kb, stride_kt, stride_kh, PAGE, BLOCK_N, D,
                                   UPCAST)
        m, denom, acc = softmax_step(q, k, v, valid, m, denom, acc, phi, scale_log2, ASYNC)
    return m, denom, acc


@triton.jit
def store_rows(OUT, out, b, hk, stride_ob, stride_oh, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
               D: tl.constexpr):
    rows = tl.arange(0, BLOCK_H)
    heads = hk * GROUP + rows
    ptr = OUT + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + tl.arange(0, D)[None, :]
    tl.store(ptr, out.to(OUT.dtype.element_ty), mask=(rows < GROUP)[:, None])

