"""Faster Flash Decoding in Triton: quantize-on-write and the fused decode (scan, select, refine,
accumulate, exact tail) with a split-KV log-sum-exp merge. The rule and the key format are those
of `kernels/ffd_reference.py` (its docstring is the specification); this file only makes it fast.

Decode, three launches, all with static grids and device-side lengths (graph-safe):
  1. `_pseudo_max_kernel` (sequence, KV head, part): each part is one sink block, one window block
     or the exact tail; it writes its row max over the sink / local-window tokens (refined keys in
     full blocks, exact keys in the tail). The threshold is th = max over parts - δ (log2 units).
  2. `_ffd_split_kernel` (sequence, KV head, split): the G query heads of a KV head are the rows of
     one tile (padded to 16 for `tl.dot`), so every byte is read once per step. Each split walks
     a contiguous range of full blocks: 2-bit scan as four [rows x D/4] x [D/4 x BS] dots, one per
     code plane (`(byte >> 2j) & 3` is channel range j, so no shuffles); a block is kept when any
     row's block max reaches its threshold, or it overlaps the sinks or the window; only kept
     blocks read their FP8 residual and V (online softmax in base 2). Split 0 also attends the
     exact tail (tokens past the last full block).
  3. `_merge_kernel` (sequence, query head): log-sum-exp merge of the used splits.
Ranges: blocks per split = max(ceil(full blocks / splits), MIN_PER_SPLIT) and the merge uses the
same formula, so no block is skipped or counted twice at any length (the official code's I5).
"auto": a sequence shorter than `min_ffd_len` runs the same grid over its exact keys (dense
split-KV, i.e. Flash-Decoding), per sequence, so mixed batches need no host decision.

Precision: the 2-bit scan dots q*scale rounded to bf16 (selection only). A kept block's score is
q.(2-bit key) with q*scale split into bf16 hi + lo parts (~fp32-accurate), plus q.residual in q's
dtype, the residual (e4m3 * scale / R) rounded to it: in bf16 a relative error of 2^-9 on a term
whose own e4m3 rounding is up to 2^-4, so the refined logits are as accurate as the stored keys
allow. P.V runs in V's dtype, fp32 accumulate.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.ffd_reference import RESIDUAL_SCALE, FFDParams
from kernels.vendor import interpreting, num_compute_units

LOG2E = 1.4426950408889634
INV_RES_SCALE: tl.constexpr = tl.constexpr(1.0 / RESIDUAL_SCALE)   # residual units -> channel scales


# ----- quantize on write ---------------------------------------------------------------------

@triton.jit
def _round_to_e4m3(x):
    """x (fp32) -> the nearest FP8 E4M3 value (ties to even, saturating at 448), still fp32.

    Done in fp32 arithmetic so that the final `.to(float8e4nv)` is exact on every backend
    (the interpreter's own conversion rounds ties and subnormals differently from torch).
    """
    a = tl.minimum(tl.abs(x), 448.0)
    e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    ulp_e = tl.maximum(e - 130, -9)                      # 3 mantissa bits; subnormal step 2^-9
    ulp = ((ulp_e + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - ulp_e) << 23).to(tl.float32, bitcast=True)
    r = ((a * inv + 8388608.0) - 8388608.0) * ulp        # round half to even at the ulp
    sign = (x.to(tl.int32, bitcast=True) >> 31) << 31    # x's sign bit, so -0 stays -0 as in torch
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_kernel(K, SLOTS, CODES, SCALES, RES, stride_kb, stride_kt, stride_kh,
                     NUM_KV_HEADS: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, D4: tl.constexpr,
                     RES_SCALE: tl.constexpr, UPCAST: tl.constexpr):
    t = tl.program_id(0)
    hk = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if (slot >= 0) & (slot % BS == BS - 1):              # this token completed its page
        page = slot // BS
        rows = tl.arange(0, BS)
        cols = tl.arange(0, D4)
        src = K + page * stride_kb + hk * stride_kh + rows[:, None].to(tl.int64) * stride_kt
        qbase = page * NUM_KV_HEADS + hk
        packed = tl.zeros([BS, D4], tl.int32)
        for j in tl.static_range(4):
            k = tl.load(src + j * D4 + cols[None, :]).to(tl.float32)
            s = tl.maximum(tl.max(tl.abs(k), 0) * 0.6666666666666666, 1e-8)
            x = tl.div_rn(k, s[None, :])
            code = tl.minimum(tl.maximum(tl.floor(x) + 2.0, 0.0), 3.0)
            packed = packed | (code.to(tl.int32) << (2 * j))
            res = _round_to_e4m3((x - (code - 1.5)) * RES_SCALE)     # in units of s / R (exact: R = 2^k)
            tl.store(SCALES + qbase * D + j * D4 + cols, s)
            tl.store(RES + (qbase * BS + rows[:, None]) * D + j * D4 + cols[None, :], res.to(tl.float8e4nv))
        tl.store(CODES + (qbase * BS + rows[:, None]) * D4 + cols[None, :], packed.to(tl.uint8))


def quantize_on_write(k_cache: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                      residual: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize each page whose last row a token of this step wrote (after the K/V store).

    One program per (token, KV head); the page-full test runs on the device: graph-safe.
    """
    num_tokens = slot_mapping.shape[0]
    _, bs, kv_heads, dim = k_cache.shape
    if num_tokens == 0:
        return
    if k_cache.stride(3) != 1 or not (codes.is_contiguous() and scales.is_contiguous() and residual.is_contiguous()):
        raise ValueError("quantize_on_write needs a contiguous head dim and contiguous quantized tensors")
    _quantize_kernel[(num_tokens, kv_heads)](
        k_cache, slot_mapping, codes, scales, residual, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=kv_heads, BS=bs, D=dim, D4=dim // 4, RES_SCALE=RESIDUAL_SCALE, UPCAST=interpreting(),
        num_warps=4)


# ----- decode ----------------------------------------------------------------------------------

@triton.jit
def _load_q_plane(Q, b, heads, row_ok, stride_qb, stride_qh, j: tl.constexpr, D4: tl.constexpr):
    return tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + j * D4 + tl.arange(0, D4)[None, :],
                   mask=row_ok[:, None], other=0.0)


@triton.jit
def _plane_dot(acc, qs, plane, UPCAST: tl.constexpr):
    if UPCAST:
        return acc + tl.dot(qs, tl.trans(plane), input_precision="ieee")
    return acc + tl.dot(qs.to(tl.bfloat16), tl.trans(plane))


@triton.jit
def _res_plane(RES_PLANE, s):
    """Residual plane [BS, D4] in key units (fp32): stored e4m3 * s / R."""
    return tl.load(RES_PLANE).to(tl.float32) * (s * INV_RES_SCALE)[None, :]


@triton.jit
def _quant_scores(q0, q1, q2, q3, CODES, SCALES, RES, page, hk,
                  NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                  D4: tl.constexpr, REFINE: tl.constexpr, UPCAST: tl.constexpr):
    """Raw scores q.k [BLOCK_H, BS] of one full block: 2-bit keys, or refined keys if REFINE."""
    qbase = page.to(tl.int64) * NUM_KV_HEADS + hk
    cols = tl.arange(0, D4)
    toks = tl.arange(0, BS)
    s0 = tl.load(SCALES + qbase * D + 0 * D4 + cols)
    s1 = tl.load(SCALES + qbase * D + 1 * D4 + cols)
    s2 = tl.load(SCALES + qbase * D + 2 * D4 + cols)
    s3 = tl.load(SCALES + qbase * D + 3 * D4 + cols)
    qs0 = q0.to(tl.float32) * s0[None, :]
    qs1 = q1.to(tl.float32) * s1[None, :]
    qs2 = q2.to(tl.float32) * s2[None, :]
    qs3 = q3.to(tl.float32) * s3[None, :]
    zero = 1.5 * (tl.sum(qs0, 1) + tl.sum(qs1, 1) + tl.sum(qs2, 1) + tl.sum(qs3, 1))
    byte = tl.load(CODES + (qbase * BS + toks[:, None]) * D4 + cols[None, :]).to(tl.int32)
    if UPCAST:
        ctype = tl.float32
    else:
        ctype = tl.bfloat16
    p0 = (byte & 3).to(ctype)
    p1 = ((byte >> 2) & 3).to(ctype)
    p2 = ((byte >> 4) & 3).to(ctype)
    p3 = ((byte >> 6) & 3).to(ctype)
    raw = tl.zeros([BLOCK_H, BS], tl.float32)
    raw = _plane_dot(raw, qs0, p0, UPCAST)
    raw = _plane_dot(raw, qs1, p1, UPCAST)
    raw = _plane_dot(raw, qs2, p2, UPCAST)
    raw = _plane_dot(raw, qs3, p3, UPCAST)
    if REFINE:
        if not UPCAST:   # the bf16 rounding error of q*scale, as a second bf16 term
            raw = _plane_dot(raw, qs0 - qs0.to(tl.bfloat16).to(tl.float32), p0, UPCAST)
            raw = _plane_dot(raw, qs1 - qs1.to(tl.bfloat16).to(tl.float32), p1, UPCAST)
            raw = _plane_dot(raw, qs2 - qs2.to(tl.bfloat16).to(tl.float32), p2, UPCAST)
            raw = _plane_dot(raw, qs3 - qs3.to(tl.bfloat16).to(tl.float32), p3, UPCAST)
        rptr = RES + (qbase * BS + toks[:, None]) * D + cols[None, :]
        raw += tl.dot(q0, tl.trans(_res_plane(rptr + 0 * D4, s0).to(q0.dtype)))
        raw += tl.dot(q1, tl.trans(_res_plane(rptr + 1 * D4, s1).to(q1.dtype)))
        raw += tl.dot(q2, tl.trans(_res_plane(rptr + 2 * D4, s2).to(q2.dtype)))
        raw += tl.dot(q3, tl.trans(_res_plane(rptr + 3 * D4, s3).to(q3.dtype)))
    return raw - zero[:, None]


@triton.jit
def _exact_tile(q, K, V, bt_row, blk, L, hk, stride_kb, stride_kt, stride_kh,
                BS: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr):
    """Raw exact scores [BLOCK_H, BS] of page `blk` of the sequence, its V tile, token validity."""
    page = tl.load(bt_row + blk, mask=blk * BS < L, other=0).to(tl.int64)   # the tail may be empty
    toks = tl.arange(0, BS)
    valid = blk * BS + toks < L
    ptr = page * stride_kb + toks[:, None].to(tl.int64) * stride_kt + hk * stride_kh + tl.arange(0, D)[None, :]
    k = tl.load(K + ptr, mask=valid[:, None], other=0.0)
    v = tl.load(V + ptr, mask=valid[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return tl.dot(q, tl.trans(k)), v, valid


@triton.jit
def _v_tile(V, bt_row, blk, hk, stride_kb, stride_kt, stride_kh, BS: tl.constexpr, D: tl.constexpr,
            UPCAST: tl.constexpr):
    page = tl.load(bt_row + blk).to(tl.int64)
    toks = tl.arange(0, BS)
    v = tl.load(V + page * stride_kb + toks[:, None].to(tl.int64) * stride_kt + hk * stride_kh
                + tl.arange(0, D)[None, :])
    if UPCAST:
        v = v.to(tl.float32)
    return v


@triton.jit
def _online(m, l, acc, z, v):
    """One online-softmax step (base 2) with scores z [BLOCK_H, BS] (-inf = masked) and V tile."""
    m_new = tl.maximum(m, tl.max(z, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(z - m_new[:, None])
    return m_new, l * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _in_window(tok, L, sink, window):
    return (tok < sink) | (tok > L - 1 - window)


@triton.jit
def _load_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                 D4: tl.constexpr, UPCAST: tl.constexpr):
    """q rows [BLOCK_H, D] of KV head hk and its four channel planes [BLOCK_H, D/4]."""
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < GROUP
    heads = hk * GROUP + rows
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + tl.arange(0, D)[None, :],
                mask=row_ok[:, None], other=0.0)
    q0 = _load_q_plane(Q, b, heads, row_ok, stride_qb, stride_qh, 0, D4)
    q1 = _load_q_plane(Q, b, heads, row_ok, stride_qb, stride_qh, 1, D4)
    q2 = _load_q_plane(Q, b, heads, row_ok, stride_qb, stride_qh, 2, D4)
    q3 = _load_q_plane(Q, b, heads, row_ok, stride_qb, stride_qh, 3, D4)
    if UPCAST:
        q, q0, q1, q2, q3 = q.to(tl.float32), q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32), q3.to(tl.float32)
    return q, q0, q1, q2, q3


@triton.jit
def _pseudo_max_kernel(Q, K, V, CODES, SCALES, RES, BT, SEQ, PM,
                       stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                       scale_log2, sink, window, min_ffd_len,
                       SINK_PARTS: tl.constexpr, NUM_PARTS: tl.constexpr, NUM_HEADS: tl.constexpr,
                       NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                       D4: tl.constexpr, BS: tl.constexpr, UPCAST: tl.constexpr):
    """Partial pseudo-max: part p < SINK_PARTS is sink block p, then the window's blocks, the last
    part the exact tail. Each writes the row max over its tokens in the sinks or the window."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    part = tl.program_id(2)
    L = tl.load(SEQ + b)
    nq = L // BS
    rows = tl.arange(0, BLOCK_H)
    toks = tl.arange(0, BS)
    best = tl.full([BLOCK_H], float("-inf"), tl.float32)
    if L >= min_ffd_len:
        q, q0, q1, q2, q3 = _load_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP, BLOCK_H, D, D4, UPCAST)
        bt_row = BT + b.to(tl.int64) * stride_bt
        if part == NUM_PARTS - 1:
            raw, _, valid = _exact_tile(q, K, V, bt_row, nq, L, hk, stride_kb, stride_kt, stride_kh, BS, D, UPCAST)
            ok = valid & _in_window(nq * BS + toks, L, sink, window)
            best = tl.max(tl.where(ok[None, :], raw * scale_log2, float("-inf")), 1)
        else:
            sink_blocks = tl.minimum(tl.cdiv(sink, BS), nq)
            first_window = tl.maximum(tl.maximum(L - window, 0) // BS, sink_blocks)
            blk = tl.where(part < SINK_PARTS, part, first_window + part - SINK_PARTS)
            useful = tl.where(part < SINK_PARTS, blk < sink_blocks, blk < nq)
            if useful:
                page = tl.load(bt_row + blk)
                z = _quant_scores(q0, q1, q2, q3, CODES, SCALES, RES, page, hk, NUM_KV_HEADS, BLOCK_H, BS, D, D4,
                                  True, UPCAST) * scale_log2
                best = tl.max(tl.where(_in_window(blk * BS + toks, L, sink, window)[None, :], z, float("-inf")), 1)
    heads = hk * GROUP + rows
    tl.store(PM + ((b.to(tl.int64) * NUM_HEADS + heads) * NUM_PARTS + part), best, mask=rows < GROUP)


@triton.jit
def _ffd_split_kernel(Q, K, V, CODES, SCALES, RES, BT, SEQ, PM, P_ACC, P_ML, STATS, MASK,
                      stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_mask,
                      scale_log2, delta_log2, sink, window, min_ffd_len,
                      NUM_SPLITS: tl.constexpr, MIN_PER_SPLIT: tl.constexpr, NUM_PARTS: tl.constexpr,
                      PARTS_PAD: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                      GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, D4: tl.constexpr,
                      BS: tl.constexpr, UPCAST: tl.constexpr, COUNT: tl.constexpr, WRITE_MASK: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(SEQ + b)
    dense = L < min_ffd_len
    nq = tl.where(dense, 0, L // BS)
    units = tl.where(dense, tl.cdiv(L, BS), nq)          # pages this sequence's splits walk
    per = tl.maximum(tl.cdiv(units, NUM_SPLITS), MIN_PER_SPLIT)
    lo = split * per
    hi = tl.minimum(lo + per, units)
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < GROUP
    heads = hk * GROUP + rows
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    kept = L * 0
    has_tail = (L > nq * BS) & (split == 0) & (dense == 0)
    if (lo < hi) | has_tail:
        q, q0, q1, q2, q3 = _load_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP, BLOCK_H, D, D4, UPCAST)
        bt_row = BT + b.to(tl.int64) * stride_bt
        if dense:
            # "auto" below the crossover: dense split-KV over the exact keys (Flash-Decoding)
            for blk in range(lo, hi):
                raw, v, valid = _exact_tile(q, K, V, bt_row, blk, L, hk, stride_kb, stride_kt, stride_kh, BS, D,
                                            UPCAST)
                m, l, acc = _online(m, l, acc, tl.where(valid[None, :], raw * scale_log2, float("-inf")), v)
        else:
            parts = tl.arange(0, PARTS_PAD)
            pm = tl.load(PM + (b.to(tl.int64) * NUM_HEADS + heads)[:, None] * NUM_PARTS + parts[None, :],
                         mask=row_ok[:, None] & (parts < NUM_PARTS)[None, :], other=float("-inf"))
            th = tl.where(row_ok, tl.max(pm, 1) - delta_log2, float("inf"))   # padding rows keep nothing
            sink_blocks = tl.minimum(tl.cdiv(sink, BS), nq)
            forced_hi = tl.maximum(L - window, 0)              # blocks ending after this: window
            for blk in range(lo, hi):
                page = tl.load(bt_row + blk)
                z2 = _quant_scores(q0, q1, q2, q3, CODES, SCALES, RES, page, hk, NUM_KV_HEADS, BLOCK_H, BS, D,
                                   D4, False, UPCAST) * scale_log2
                hit = tl.max(tl.where(tl.max(z2, 1) >= th, 1, 0), 0)
                keep = (hit > 0) | (blk < sink_blocks) | ((blk + 1) * BS > forced_hi)
                if WRITE_MASK:   # test output: the keep decision of every visited block
                    tl.store(MASK + (b.to(tl.int64) * NUM_KV_HEADS + hk) * stride_mask + blk, keep.to(tl.int8))
                if keep:
                    z = _quant_scores(q0, q1, q2, q3, CODES, SCALES, RES, page, hk, NUM_KV_HEADS, BLOCK_H, BS, D,
                                      D4, True, UPCAST) * scale_log2
                    m, l, acc = _online(m, l, acc, z, _v_tile(V, bt_row, blk, hk, stride_kb, stride_kt, stride_kh,
                                                              BS, D, UPCAST))
                    kept += 1
            if has_tail:                                       # the exact tail, once per sequence
                raw, v, valid = _exact_tile(q, K, V, bt_row, nq, L, hk, stride_kb, stride_kt, stride_kh, BS, D,
                                            UPCAST)
                m, l, acc = _online(m, l, acc, tl.where(valid[None, :], raw * scale_log2, float("-inf")), v)
    part = (b.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
    tl.store(P_ACC + part[:, None] * D + tl.arange(0, D)[None, :], acc, mask=row_ok[:, None])
    tl.store(P_ML + part * 2, m, mask=row_ok)
    tl.store(P_ML + part * 2 + 1, l, mask=row_ok)
    if COUNT:
        if split == 0:
            tl.atomic_add(STATS, nq.to(tl.int64))
        tl.atomic_add(STATS + 1, kept.to(tl.int64))


@triton.jit
def _merge_kernel(SEQ, OUT, P_ACC, P_ML, stride_ob, stride_oh, min_ffd_len,
                  NUM_SPLITS: tl.constexpr, MIN_PER_SPLIT: tl.constexpr, CHUNK: tl.constexpr,
                  NUM_HEADS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    """Log-sum-exp merge of one (sequence, query head)'s used splits, vectorised over splits."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    L = tl.load(SEQ + b)
    units = tl.where(L < min_ffd_len, tl.cdiv(L, BS), L // BS)
    per = tl.maximum(tl.cdiv(units, NUM_SPLITS), MIN_PER_SPLIT)
    used = tl.maximum(tl.cdiv(units, per), 1)           # split 0 always holds the tail
    base = (b.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS
    s = tl.arange(0, NUM_SPLITS)
    ok = s < used
    m_s = tl.load(P_ML + (base + s) * 2, mask=ok, other=float("-inf"))
    l_s = tl.load(P_ML + (base + s) * 2 + 1, mask=ok, other=0.0)
    m_all = tl.max(m_s, 0)
    w = tl.where(m_s == float("-inf"), 0.0, tl.exp2(m_s - m_all))
    l_all = tl.sum(w * l_s, 0)
    acc = tl.zeros([D], tl.float32)
    for c in range(0, tl.cdiv(used, CHUNK)):
        sc = c * CHUNK + tl.arange(0, CHUNK)
        okc = sc < used
        m_c = tl.load(P_ML + (base + sc) * 2, mask=okc, other=float("-inf"))
        w_c = tl.where(m_c == float("-inf"), 0.0, tl.exp2(m_c - m_all))
        a_c = tl.load(P_ACC + (base + sc)[:, None] * D + tl.arange(0, D)[None, :], mask=okc[:, None], other=0.0)
        acc += tl.sum(a_c * w_c[:, None], 0)
    out = acc / tl.where(l_all > 0, l_all, 1.0)
    tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + tl.arange(0, D), out.to(OUT.dtype.element_ty))


def choose_splits(batch: int, num_kv_heads: int, device: torch.device) -> int:
    """About eight programs per SM at this batch size, a power of two <= 128 (B only: graph-safe).

    Many small programs keep enough 2-bit scan loads in flight to reach HBM bandwidth; each
    sequence uses only the splits its length needs (at least MIN_PER_SPLIT blocks each)."""
    target = 8 * num_compute_units(device)
    return min(128, triton.next_power_of_2(max(1, math.ceil(target / max(1, batch * num_kv_heads)))))


MIN_PER_SPLIT = 4      # blocks: below this a split's fixed cost (q, threshold, partial) dominates
MERGE_CHUNK = 16


def ffd_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, codes: torch.Tensor,
               scales: torch.Tensor, residual: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               *, scale: float, params: FFDParams, num_splits: int | None = None,
               stats: torch.Tensor | None = None, out: torch.Tensor | None = None,
               masks: torch.Tensor | None = None) -> torch.Tensor:
    """q[B, Hq, D] -> out[B, Hq, D] under the FFD rule (decode: one query per sequence).

    k/v_cache [N, BS, Hkv, D] exact pages; codes/scales/residual the same pages quantized
    (`kernels.ffd_reference`). `stats` (int64 [2], optional) += (full blocks, kept blocks) over
    (sequence, KV head) pairs; `masks` (int8 [B, Hkv, >= max blocks], optional, for tests) gets
    1/0 for every full block the kernel visited. `num_splits` is rounded up to a power of two.
    Raises for shapes the kernel does not serve.
    """
    batch, num_heads, dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    if bs != params.block_size:
        raise ValueError(f"KV page size {bs} != ffd block size {params.block_size}")
    if dim not in (64, 128, 256) or k_cache.shape[3] != dim:
        raise ValueError(f"FFD's Triton kernel serves head_dim 64, 128 or 256 (D/4 >= 16 for tl.dot); got {dim}")
    if num_heads % kv_heads or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("FFD decode: Hq must be a multiple of Hkv, K/V pages must share strides, "
                         "and head dims must be contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables and seq_lens must be int32, block_tables rows contiguous")
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    group = num_heads // kv_heads
    splits = triton.next_power_of_2(int(num_splits or choose_splits(batch, kv_heads, q.device)))
    min_per = 1 if num_splits else MIN_PER_SPLIT
    sink_parts = -(-params.sink_tokens // bs)
    num_parts = sink_parts + (-(-params.local_window // bs) + 1) + 1
    pm = torch.empty(batch * num_heads * num_parts, dtype=torch.float32, device=q.device)
    p_acc = torch.empty(batch * num_heads * splits * dim, dtype=torch.float32, device=q.device)
    p_ml = torch.empty(batch * num_heads * splits * 2, dtype=torch.float32, device=q.device)
    block_h = max(16, triton.next_power_of_2(group))
    delta = params.delta_log2 if math.isfinite(params.delta_log2) else 1e30
    common = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=kv_heads, GROUP=group, BLOCK_H=block_h, D=dim, D4=dim // 4,
                  BS=bs, UPCAST=interpreting())
    strides = (q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
               block_tables.stride(0))
    _pseudo_max_kernel[(batch, kv_heads, num_parts)](
        q, k_cache, v_cache, codes, scales, residual, block_tables, seq_lens, pm, *strides,
        scale * LOG2E, params.sink_tokens, params.local_window, params.min_ffd_len,
        SINK_PARTS=sink_parts, NUM_PARTS=num_parts, num_warps=4, **common)
    _ffd_split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, codes, scales, residual, block_tables, seq_lens, pm, p_acc, p_ml,
        stats if stats is not None else p_ml, masks if masks is not None else p_ml, *strides,
        masks.shape[2] if masks is not None else 0,
        scale * LOG2E, delta, params.sink_tokens, params.local_window, params.min_ffd_len,
        NUM_SPLITS=splits, MIN_PER_SPLIT=min_per, NUM_PARTS=num_parts,
        PARTS_PAD=triton.next_power_of_2(num_parts), COUNT=stats is not None, WRITE_MASK=masks is not None,
        num_warps=4, **common)
    _merge_kernel[(batch, num_heads)](seq_lens, out, p_acc, p_ml, out.stride(0), out.stride(1),
                                      params.min_ffd_len, NUM_SPLITS=splits, MIN_PER_SPLIT=min_per,
                                      CHUNK=min(MERGE_CHUNK, splits), NUM_HEADS=num_heads, D=dim, BS=bs,
                                      num_warps=4)
    return out
