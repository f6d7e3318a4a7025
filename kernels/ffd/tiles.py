"""The FFD kernels' shared device pieces: loads of q, codes, scales, residuals and K/V rows; the
2-bit, residual and refined-key dots; the online softmax; the programmatic-launch hooks. Used by the
decode's scan and attend (`kernels/ffd/scan.py`, `kernels/ffd/attend.py`) and by the prefill
(`kernels/ffd/prefill.py`); `kernels/ffd/decode.py` says what each computes and at what precision.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.attention.kv_store import key_page
from kernels.ffd.ptx import (
    INV_RES_SCALE,
    PLANE_ASM_0,
    PLANE_ASM_1,
    PLANE_ASM_2,
    PLANE_ASM_3,
    REFINED_ASM_0,
    REFINED_ASM_1,
    REFINED_ASM_2,
    REFINED_ASM_3,
    RES_ASM,
    RES_Q_SCALE,
    RES_UNSCALE,
)

try:   # NVIDIA builds of Triton; the others never launch programmatically (`programmatic_launch`)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _load_q_plane(Q, b, heads, row_ok, stride_qb, stride_qh, j: tl.constexpr, D4: tl.constexpr):
    return tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + j * D4 + tl.arange(0, D4)[None, :],
                   mask=row_ok[:, None], other=0.0)


@triton.jit
def _load_scales(SCALES, qbase, D: tl.constexpr, D4: tl.constexpr):
    """The four channel-range scales [D/4] of one quantized page (qbase = page * Hkv + hk)."""
    cols = tl.arange(0, D4)
    s0 = tl.load(SCALES + qbase * D + 0 * D4 + cols)
    s1 = tl.load(SCALES + qbase * D + 1 * D4 + cols)
    s2 = tl.load(SCALES + qbase * D + 2 * D4 + cols)
    s3 = tl.load(SCALES + qbase * D + 3 * D4 + cols)
    return s0, s1, s2, s3


@triton.jit
def _load_codes(CODES, qbase, BS: tl.constexpr, D4: tl.constexpr):
    toks = tl.arange(0, BS)
    return tl.load(CODES + (qbase * BS + toks[:, None]) * D4 + tl.arange(0, D4)[None, :])


@triton.jit
def _load_residual(RES, qbase, BS: tl.constexpr, D: tl.constexpr, D4: tl.constexpr):
    """The stored e4m3 residual of one page as four channel-range planes [BS, D/4]."""
    rptr = RES + (qbase * BS + tl.arange(0, BS)[:, None]) * D + tl.arange(0, D4)[None, :]
    return tl.load(rptr + 0 * D4), tl.load(rptr + 1 * D4), tl.load(rptr + 2 * D4), tl.load(rptr + 3 * D4)


@triton.jit
def _plane_bits(byte, ASM: tl.constexpr, INT8: tl.constexpr):
    """Four codes per PTX string: as bf16 in two registers, or (INT8) as int8 lanes in one."""
    if INT8:
        return tl.inline_asm_elementwise(asm=ASM, constraints="=r,r", args=[byte], dtype=tl.int8, is_pure=True,
                                         pack=4)
    else:
        return tl.inline_asm_elementwise(asm=ASM, constraints="=r,=r,r", args=[byte], dtype=tl.bfloat16,
                                         is_pure=True, pack=4)


@triton.jit
def _plane_of(byte, j: tl.constexpr, ASM_0: tl.constexpr, ASM_1: tl.constexpr, ASM_2: tl.constexpr,
              ASM_3: tl.constexpr, INT8: tl.constexpr):
    """Plane j of a uint8 code tile through the j-th of four PTX strings (a constexpr choice)."""
    if j == 0:
        return _plane_bits(byte, ASM_0, INT8)
    if j == 1:
        return _plane_bits(byte, ASM_1, INT8)
    if j == 2:
        return _plane_bits(byte, ASM_2, INT8)
    return _plane_bits(byte, ASM_3, INT8)


@triton.jit
def _code_plane(byte, j: tl.constexpr, UPCAST: tl.constexpr):
    """Code plane j of a uint8 code tile as its levels (code - 1.5), exact.

    GPU: bf16 built from the bits (`plane_asm`); interpreter: fp32 arithmetic, same values."""
    if UPCAST:
        return ((byte.to(tl.int32) >> (2 * j)) & 3).to(tl.float32) - 1.5
    return _plane_of(byte, j, PLANE_ASM_0, PLANE_ASM_1, PLANE_ASM_2, PLANE_ASM_3, False)


@triton.jit
def _plane_term(raw, qs, plane_t, REFINE: tl.constexpr, UPCAST: tl.constexpr):
    """raw + qs . plane_t (2-D, or batched 3-D). GPU: qs rounded to bf16; with REFINE its rounding
    error is a second bf16 term (hi + lo), so the product is ~fp32-exact."""
    if UPCAST:
        return tl.dot(qs, plane_t, raw, input_precision="ieee")
    hi = qs.to(tl.bfloat16)
    raw = tl.dot(hi, plane_t, raw)
    if REFINE:
        raw = tl.dot((qs - hi.to(tl.float32)).to(tl.bfloat16), plane_t, raw)
    return raw


@triton.jit
def _code_dots(q0, q1, q2, q3, s0, s1, s2, s3, byte, BLOCK_H: tl.constexpr, BS: tl.constexpr,
               REFINE: tl.constexpr, UPCAST: tl.constexpr):
    """q.(code - 1.5) s, the 2-bit scores [BLOCK_H, BS] of one block: per plane j, (q_j * s_j) dotted
    with the plane's levels."""
    raw = tl.zeros([BLOCK_H, BS], tl.float32)
    raw = _plane_term(raw, q0.to(tl.float32) * s0[None, :], tl.trans(_code_plane(byte, 0, UPCAST)), REFINE, UPCAST)
    raw = _plane_term(raw, q1.to(tl.float32) * s1[None, :], tl.trans(_code_plane(byte, 1, UPCAST)), REFINE, UPCAST)
    raw = _plane_term(raw, q2.to(tl.float32) * s2[None, :], tl.trans(_code_plane(byte, 2, UPCAST)), REFINE, UPCAST)
    raw = _plane_term(raw, q3.to(tl.float32) * s3[None, :], tl.trans(_code_plane(byte, 3, UPCAST)), REFINE, UPCAST)
    return raw


@triton.jit
def _res_plane(r, s):
    """Stored residual plane [BS, D4] (e4m3) in key units (fp32): r * s / R."""
    return r.to(tl.float32) * (s * INV_RES_SCALE)[None, :]


@triton.jit
def _res_bits(r):
    """Stored residual plane (e4m3) as bf16 of r * 2^-RES_BITS_EXP, from the bits (`RES_ASM`)."""
    return tl.inline_asm_elementwise(asm=RES_ASM, constraints="=r,=r,r", args=[r.to(tl.uint8, bitcast=True)],
                                     dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _res_dots(raw, q0, q1, q2, q3, s0, s1, s2, s3, r0, r1, r2, r3, UPCAST: tl.constexpr):
    """raw + q.residual (the residual = e4m3 * s / R).

    GPU: the e4m3 bytes become bf16 without a conversion unit (`_res_bits`) and s / R goes to the q
    side, with powers of two that keep both operands and the products in range (q*s up to 2^72):
    the one rounding is q*s to bf16, 2^-9 relative, the same as rounding the scaled residual.
    Interpreter: the residual in fp32, dotted with q."""
    if UPCAST:
        raw += tl.dot(q0, tl.trans(_res_plane(r0, s0)), input_precision="ieee")
        raw += tl.dot(q1, tl.trans(_res_plane(r1, s1)), input_precision="ieee")
        raw += tl.dot(q2, tl.trans(_res_plane(r2, s2)), input_precision="ieee")
        raw += tl.dot(q3, tl.trans(_res_plane(r3, s3)), input_precision="ieee")
        return raw
    res = tl.dot((q0.to(tl.float32) * (s0 * RES_Q_SCALE)[None, :]).to(tl.bfloat16), tl.trans(_res_bits(r0)))
    res = tl.dot((q1.to(tl.float32) * (s1 * RES_Q_SCALE)[None, :]).to(tl.bfloat16), tl.trans(_res_bits(r1)), res)
    res = tl.dot((q2.to(tl.float32) * (s2 * RES_Q_SCALE)[None, :]).to(tl.bfloat16), tl.trans(_res_bits(r2)), res)
    res = tl.dot((q3.to(tl.float32) * (s3 * RES_Q_SCALE)[None, :]).to(tl.bfloat16), tl.trans(_res_bits(r3)), res)
    return raw + res * RES_UNSCALE


@triton.jit
def _refined_plane(byte, r, j: tl.constexpr):
    """Refined key plane j [BS, D/4], bf16(code - 1.5 + r / R) (`refined_plane_asm`; GPU only)."""
    rb = r.to(tl.uint8, bitcast=True)
    if j == 0:
        asm: tl.constexpr = REFINED_ASM_0
    elif j == 1:
        asm: tl.constexpr = REFINED_ASM_1  # type: ignore[no-redef]  # the jit reads each branch's annotation
    elif j == 2:
        asm: tl.constexpr = REFINED_ASM_2  # type: ignore[no-redef]  # the jit reads each branch's annotation
    else:
        asm: tl.constexpr = REFINED_ASM_3  # type: ignore[no-redef]  # the jit reads each branch's annotation
    return tl.inline_asm_elementwise(asm=asm, constraints="=r,=r,r,r", args=[byte, rb], dtype=tl.bfloat16,
                                     is_pure=True, pack=4)


@triton.jit
def _refined_dots(q0, q1, q2, q3, s0, s1, s2, s3, byte, r0, r1, r2, r3, BLOCK_H: tl.constexpr, BS: tl.constexpr,
                  UPCAST: tl.constexpr):
    """Refined scores q.k [BLOCK_H, BS] of one kept block for the softmax: per plane j, bf16(q_j s_j)
    dotted with the refined key in channel-scale units, bf16(code - 1.5 + r / R): the precision of a
    bf16 key cache, one dot per plane. (The threshold keeps the ~fp32-exact form of `_quant_scores`:
    selection must not move with the rounding.) Interpreter: fp32, as `_quant_scores`."""
    if UPCAST:
        raw = _code_dots(q0, q1, q2, q3, s0, s1, s2, s3, byte, BLOCK_H, BS, True, UPCAST)
        return _res_dots(raw, q0, q1, q2, q3, s0, s1, s2, s3, r0, r1, r2, r3, UPCAST)
    raw = tl.zeros([BLOCK_H, BS], tl.float32)
    raw = tl.dot((q0.to(tl.float32) * s0[None, :]).to(tl.bfloat16), tl.trans(_refined_plane(byte, r0, 0)), raw)
    raw = tl.dot((q1.to(tl.float32) * s1[None, :]).to(tl.bfloat16), tl.trans(_refined_plane(byte, r1, 1)), raw)
    raw = tl.dot((q2.to(tl.float32) * s2[None, :]).to(tl.bfloat16), tl.trans(_refined_plane(byte, r2, 2)), raw)
    raw = tl.dot((q3.to(tl.float32) * s3[None, :]).to(tl.bfloat16), tl.trans(_refined_plane(byte, r3, 3)), raw)
    return raw


@triton.jit
def _quant_scores(q0, q1, q2, q3, CODES, SCALES, RES, page, hk, sl,
                  NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BS: tl.constexpr, SLICES: tl.constexpr,
                  D: tl.constexpr, D4: tl.constexpr, REFINE: tl.constexpr, UPCAST: tl.constexpr):
    """Raw scores q.k [BLOCK_H, BS] of tokens [sl * BS, (sl + 1) * BS) of one full block of SLICES * BS
    tokens (SLICES = 1: the whole block): 2-bit keys, or refined keys if REFINE."""
    qbase = page.to(tl.int64) * NUM_KV_HEADS + hk
    s0, s1, s2, s3 = _load_scales(SCALES, qbase, D, D4)
    rows = qbase * SLICES + sl        # a (page, head)'s tokens are contiguous: the slice is a page of BS
    byte = _load_codes(CODES, rows, BS, D4)
    if REFINE:
        r0, r1, r2, r3 = _load_residual(RES, rows, BS, D, D4)
    raw = _code_dots(q0, q1, q2, q3, s0, s1, s2, s3, byte, BLOCK_H, BS, REFINE, UPCAST)
    if REFINE:
        raw = _res_dots(raw, q0, q1, q2, q3, s0, s1, s2, s3, r0, r1, r2, r3, UPCAST)
    return raw


@triton.jit
def _page_tile(X, page, hk, stride_kb, stride_kt, stride_kh, valid, BS: tl.constexpr, D: tl.constexpr,
               UPCAST: tl.constexpr):
    """The [BS, D] K or V tile of KV head hk in `page`; rows outside `valid` read as 0."""
    return _token_rows(X, page, hk, tl.arange(0, BS), stride_kb, stride_kt, stride_kh, valid, D, UPCAST)


@triton.jit
def _token_rows(X, page, hk, toks, stride_kb, stride_kt, stride_kh, valid, D: tl.constexpr, UPCAST: tl.constexpr):
    """Rows `toks` [T, D] of KV head hk's K or V in `page`; rows outside `valid` read as 0."""
    x = tl.load(X + page * stride_kb + toks[:, None].to(tl.int64) * stride_kt + hk * stride_kh
                + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _exact_tile(q, K, V, KMAP, bt_row, blk, L, hk, stride_kb, stride_kt, stride_kh,
                BS: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr, HAS_KMAP: tl.constexpr):
    """Raw exact scores [BLOCK_H, BS] of page `blk` of the sequence, its V tile, token validity."""
    page = tl.load(bt_row + blk, mask=blk * BS < L, other=0).to(tl.int64)   # the tail may be empty
    valid = blk * BS + tl.arange(0, BS) < L
    k = _page_tile(K, key_page(KMAP, page, HAS_KMAP), hk, stride_kb, stride_kt, stride_kh, valid, BS, D, UPCAST)
    v = _page_tile(V, page, hk, stride_kb, stride_kt, stride_kh, valid, BS, D, UPCAST)
    return tl.dot(q, tl.trans(k)), v, valid


@triton.jit
def _online(m, denom, acc, z, v):
    """One online-softmax step (base 2) with scores z [BLOCK_H, BS] (-inf = masked) and V tile."""
    m_new = tl.maximum(m, tl.max(z, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(z - m_new[:, None])
    return m_new, denom * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _in_window(tok, L, sink, window):
    return (tok < sink) | (tok > L - 1 - window)


@triton.jit
def _load_q_planes(Q, b, hk, stride_qb, stride_qh, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                   D4: tl.constexpr, UPCAST: tl.constexpr):
    """The four channel planes [BLOCK_H, D/4] of the q rows of KV head hk (rows >= GROUP are 0)."""
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < GROUP
    heads = hk * GROUP + rows
    q0 = _load_q_plane(Q, b, heads, row_ok, stride_qb, stride_qh, 0, D4)
    q1 = _load_q_plane(Q, b, heads, row_ok, stride_qb, stride_qh, 1, D4)
    q2 = _load_q_plane(Q, b, heads, row_ok, stride_qb, stride_qh, 2, D4)
    q3 = _load_q_plane(Q, b, heads, row_ok, stride_qb, stride_qh, 3, D4)
    if UPCAST:
        q0, q1, q2, q3 = q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32), q3.to(tl.float32)
    return q0, q1, q2, q3


@triton.jit
def _load_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                 D4: tl.constexpr, UPCAST: tl.constexpr):
    """q rows [BLOCK_H, D] of KV head hk and its four channel planes [BLOCK_H, D/4]."""
    rows = tl.arange(0, BLOCK_H)
    q = tl.load(Q + b.to(tl.int64) * stride_qb + (hk * GROUP + rows)[:, None] * stride_qh + tl.arange(0, D)[None, :],
                mask=(rows < GROUP)[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q0, q1, q2, q3 = _load_q_planes(Q, b, hk, stride_qb, stride_qh, GROUP, BLOCK_H, D4, UPCAST)
    return q, q0, q1, q2, q3


@triton.jit
def _release_next(PDL: tl.constexpr):
    """Let the next launch of the decode start its prologue now (programmatic dependent launch; it
    waits in `_wait_previous` for this launch's results)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _wait_previous(PDL: tl.constexpr):
    """Block until the previous launch has finished and its writes are visible: every read of the
    previous launches' outputs comes after this."""
    if PDL:
        gdc_wait()


@triton.jit
def _quantized_len(L, min_ffd_len, BS: tl.constexpr):
    """Full (quantized) blocks the FFD rule uses; 0 for an "auto" row below the crossover (dense)."""
    return tl.where(L < min_ffd_len, 0, L // BS)
