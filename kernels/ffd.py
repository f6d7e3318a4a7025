"""Faster Flash Decoding in Triton: the decode (threshold, 2-bit scan, refine + accumulate over the
kept blocks, exact tail) with a split-KV log-sum-exp merge; quantize-on-write is
`kernels/ffd_quantize.py`. The rule and the key format are those of `kernels/ffd_reference.py` (its
docstring is the specification); this file only makes it fast.

Decode, three launches, all with grids fixed by the batch and the tensor shapes and the lengths read
on the device (graph-safe, no host sync, no data-sized allocation, deterministic):
  1. `_scan_kernel` (sequence, KV head, program) does the threshold and the 2-bit scan in one launch.
     Its lowest program ids are the pseudo-max (`_pseudo_max_part`): each takes 32 tokens of one
     sink block, one window block or the exact tail and writes its row max over the sink /
     local-window tokens (refined keys in full blocks, exact keys in the tail); the threshold is
     th = max over them - δ (log2 units). The other programs are a pure stream over the 2-bit codes
     (36 B per token and head at D = 128). Each step takes BPP full blocks at once (page ids as one
     vector, then all their codes and scales, then batched 3-D dots) and nothing in the loop
     branches on data, so Triton pipelines it. A block's scores are four [BS x D/4] x [D/4 x G]
     dots, one per code plane (`(byte >> 2j) & 3` is channel range j, no shuffles): the tokens are
     the MMA's M and the G query heads of the KV head its N, which the MMA pads to 8 (as rows, to
     16: twice the tensor-core work). The loop stores each block's per-row max, which needs no
     threshold; only after it does a program wait for its row's pseudo-max programs (a counter:
     they are dispatched first and their few tokens take far less time than the loop, so the wait
     is normally over before it starts) and turn the stored maxes into keep decisions: a block is
     kept when any row's block max reaches its threshold, or it overlaps the sinks or the window.
     It stores the kept block's page id (-1 if dropped), so the next pass reads no block table,
     and adds its kept blocks to the batch's counter (one atomic per program). One launch instead
     of two takes the pseudo-max's ~5 us chain off the critical path (H200, B = 1, 128K: 54.0 ->
     46.8 us). Where the grid is under one wave (B = 1) and its programs long, it is one full wave of
     the MMA-sum form instead (`SCAN_WAVE_MIN_STEPS`): more, shorter programs.
  2. `_attend_kernel` (sequence, KV head, split): only the kept blocks. Each split counts them,
     takes those of ranks [split * per, (split + 1) * per) (ranks by a prefix sum, so the work is
     balanced whatever the sparsity pattern), where per also spreads the batch's kept blocks over
     about the programs the GPU holds at once (one round, not several rounds of short programs that
     each pay the fixed chain of flags, ranks and q), gathers their page ids into its slot row once, then
     loops over them with no data-dependent branch: refined scores, V, online softmax in base 2,
     all loads of a block issued before its math. The last split, the one most often idle, also
     attends the exact tail (the tokens past the last full block).
  3. `_merge_kernel` (sequence, query head, channel chunk): log-sum-exp merge of all splits; an
     empty split wrote m = -inf and weighs 0.
On sm_90+ the attend and the merge are launched as programmatic dependents: they start (q loads)
while the previous launch ends and wait for its results (`griddepcontrol.wait`), about 2 us per
decode at B = 1. The scan, the first launch, is not (when the pseudo-max was a launch of its own,
a scan launched early beside it lost 4-10 us at B = 1, 128K-256K). The launches' counters live in a
small int32 buffer that every call leaves zero (`ffd_sync_buffer`).
Scan and attend are separate passes because a fused loop branches on every block's decision and
chains several memory round trips per block, which neither pipelining nor the few resident
programs can hide. "auto": a sequence shorter than `min_ffd_len` is skipped by the scan and the
attend grid runs dense split-KV over its exact keys (Flash-Decoding), per sequence, so mixed
batches need no host decision.

Arithmetic: the conversion unit (16 results per clock and SM) is the scarce resource of both
passes, so the GPU builds MMA operands from bits with a few integer instructions (`plane_asm`,
`scan_plane_asm`, `residual_asm`, `refined_plane_asm`): the code planes as their exact levels
code - 1.5 in bf16 (threshold), or as the int8 codes 0..3 themselves for the scan's int8 MMA (two
integer instructions per four codes, one K-step per plane, 1.5 * sum(q side) taken out after the
dot; H200, B = 8, 128K: 225.2 -> 206.0 us per decode against the bf16 form's 128 + f * code), the
e4m3 residual as exact bf16 times a power of two that the q side compensates (threshold) or, with
one bf16 fma per two values, added to the level (the attend's refined key).
Precision: the 2-bit scan (selection only) dots the exact levels with q*scale rounded to int8 steps
of u = max|q row| * max(block's channel scales) / 127, i.e. an error of at most u / 2 per channel
(254 steps across the largest |q s| the block can hold; bf16 keeps 2^-9 of each |q s|). The
pseudo-max, which sets the threshold, scores with q*scale split into bf16 hi + lo parts plus
q.residual with q*scale/R rounded to bf16 (~fp32-accurate, so selection matches the torch rule). A
kept block's softmax scores are bf16(q*scale) . bf16(code - 1.5 + r/R) per plane: the refined key
rounded to bf16 (at most 2^-8 of the channel scale, a quarter of the stored e4m3 residual's own
rounding; the precision of a bf16 KV cache) and one dot per plane instead of three (H200, B = 8,
128K: attend 123.4 -> 104.4 us). P.V runs in V's dtype, fp32 accumulate. Under the interpreter
(UPCAST) all of it is fp32 arithmetic.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.ffd_reference import RESIDUAL_SCALE, FFDParams
from kernels.flash_decoding import rows_per_tile
from kernels.kv_store import key_page
from kernels.occupancy import resident_ctas
from kernels.vendor import interpreting, num_compute_units, programmatic_launch

try:   # NVIDIA builds of Triton; the others never launch programmatically (`programmatic_launch`)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

LOG2E = 1.4426950408889634
INV_RES_SCALE: tl.constexpr = tl.constexpr(1.0 / RESIDUAL_SCALE)   # residual units -> channel scales
LEVELS_LO = 0xC00000C0    # low bytes of bf16(code - 1.5) for code 0..3: -1.5, -0.5, 0.5, 1.5
LEVELS_HI = 0x3F3FBFBF    # their high bytes


def _levels_ptx(j: int, out0: str, out1: str) -> str:
    """PTX body: four packed code bytes ($2) -> code plane j as two bf16x2 (out0, out1) of the levels
    code - 1.5 (temporaries t, u, lut).

    `prmt` is a byte table lookup when its selector comes from the data: t = the four 2-bit codes
    (one per byte), u = t * 0x11 + 0x40404040 puts code c in selector nibbles (c, 4 + c), which
    pick the low byte of level c from LEVELS_LO and the high byte from LEVELS_HI: about 1.7 integer
    instructions per code instead of an int -> float conversion per code, which would bound the
    scan at 16 codes per clock and SM. The levels are exact, so the dot needs no zero-point term.
    """
    codes = "and.b32 t, $2, 0x03030303; " if j == 0 else f"shr.b32 t, $2, {2 * j}; and.b32 t, t, 0x03030303; "
    return (f"mov.b32 lut, {LEVELS_LO:#x}; " + codes + "mad.lo.u32 u, t, 0x11, 0x40404040; "
            + f"prmt.b32 {out0}, lut, {LEVELS_HI:#x}, u; shr.b32 u, u, 16; prmt.b32 {out1}, lut, {LEVELS_HI:#x}, u; ")


def _residual_ptx(src: str, out0: str, out1: str) -> str:
    """PTX body: four packed e4m3 bytes (src) -> two bf16x2 (out0, out1) of value * 2^-RES_BITS_EXP,
    exact (temporary t).

    Each byte, sign-extended to 16 bits (prmt), shifted left by 4 and masked to bit 15 and bits 4-10
    is the bf16 with the e4m3 exponent and mantissa bits in place: the same number scaled by
    2^(7 - 127), for normals, subnormals and signed zeros alike. Three integer instructions per two
    values instead of e4m3 -> f16 -> f32 -> bf16 conversions."""
    return (f"prmt.b32 t, {src}, 0, 0x9180; shl.b32 t, t, 4; and.b32 {out0}, t, 0x87f087f0; "
            f"prmt.b32 t, {src}, 0, 0xb3a2; shl.b32 t, t, 4; and.b32 {out1}, t, 0x87f087f0; ")


def plane_asm(j: int) -> str:
    """PTX: four packed code bytes ($2) -> code plane j as two bf16x2 ($0, $1) of code - 1.5 (`_levels_ptx`)."""
    return "{ .reg .b32 t, u, lut; " + _levels_ptx(j, "$0", "$1") + "}"


def residual_asm() -> str:
    """PTX: four packed e4m3 bytes ($2) -> two bf16x2 ($0, $1) of value * 2^-RES_BITS_EXP (`_residual_ptx`)."""
    return "{ .reg .b32 t; " + _residual_ptx("$2", "$0", "$1") + "}"


def refined_plane_asm(j: int) -> str:
    """PTX: four code bytes ($2) and the four e4m3 residuals of their plane-j channels ($3) -> two
    bf16x2 ($0, $1) of the refined key in units of the channel scale, bf16(code - 1.5 + r / R).

    The levels and the residual bits as above, then one fma per two values, r_bits * 2^(RES_BITS_EXP)
    / R + level: the product is exact (a power of two), so the one rounding is the sum's to bf16."""
    return ("{ .reg .b32 t, u, lut, a0, a1, r0, r1, f; " + _levels_ptx(j, "a0", "a1") + _residual_ptx("$3", "r0", "r1")
            + f"mov.b32 f, {REFINE_FACTOR_BF16X2:#x}; fma.rn.bf16x2 $0, r0, f, a0; fma.rn.bf16x2 $1, r1, f, a1; }}")


RES_BITS_EXP = 120                 # `_residual_ptx`'s bf16 is the residual * 2^-RES_BITS_EXP
RES_ASM: tl.constexpr = tl.constexpr(residual_asm())
# bf16x2 of 2^RES_BITS_EXP / R: a biased exponent in bits 7-14 of each half, mantissa 0
REFINE_FACTOR_BF16X2 = ((RES_BITS_EXP - int(math.log2(RESIDUAL_SCALE)) + 127) << 7) * 0x10001
RES_Q_EXP = 56                     # q * s / R is scaled by 2^RES_Q_EXP before its bf16 rounding
RES_Q_SCALE: tl.constexpr = tl.constexpr(2.0 ** RES_Q_EXP / RESIDUAL_SCALE)
RES_UNSCALE: tl.constexpr = tl.constexpr(2.0 ** (RES_BITS_EXP - RES_Q_EXP))   # exact, back to key units

REFINED_ASM_0: tl.constexpr = tl.constexpr(refined_plane_asm(0))
REFINED_ASM_1: tl.constexpr = tl.constexpr(refined_plane_asm(1))
REFINED_ASM_2: tl.constexpr = tl.constexpr(refined_plane_asm(2))
REFINED_ASM_3: tl.constexpr = tl.constexpr(refined_plane_asm(3))

def scan_plane_asm(j: int) -> str:
    """PTX: four packed code bytes ($1) -> code plane j as four int8 lanes ($0), the codes 0..3
    themselves: (bytes >> 2j) & 0x03030303, one or two integer instructions per four codes (the bf16
    planes of `plane_asm` take four). The int8 MMA takes them as they are; the scan subtracts
    1.5 * sum(q side) after the dot, which leaves the exact levels code - 1.5."""
    shift = f"shr.b32 t, $1, {2 * j}; " if j else "mov.b32 t, $1; "
    return "{ .reg .b32 t; " + shift + "and.b32 $0, t, 0x03030303; }"


# 1.5 * 2^23 added to |x| < 2^22 (fp32) leaves round(x) (to nearest even) in the low mantissa bits
INT_ROUND: tl.constexpr = tl.constexpr(12582912.0)
INT_ROUND_BITS: tl.constexpr = tl.constexpr(0x4B400000)   # the bits of INT_ROUND itself
INT8_Q_MAX: tl.constexpr = tl.constexpr(127.0)   # the scan's int8 q side spans [-127, 127]


PLANE_ASM_0: tl.constexpr = tl.constexpr(plane_asm(0))
PLANE_ASM_1: tl.constexpr = tl.constexpr(plane_asm(1))
PLANE_ASM_2: tl.constexpr = tl.constexpr(plane_asm(2))
PLANE_ASM_3: tl.constexpr = tl.constexpr(plane_asm(3))
SCAN_ASM_0: tl.constexpr = tl.constexpr(scan_plane_asm(0))
SCAN_ASM_1: tl.constexpr = tl.constexpr(scan_plane_asm(1))
SCAN_ASM_2: tl.constexpr = tl.constexpr(scan_plane_asm(2))
SCAN_ASM_3: tl.constexpr = tl.constexpr(scan_plane_asm(3))


# ----- decode: shared pieces ---------------------------------------------------------------------

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
        asm: tl.constexpr = REFINED_ASM_1
    elif j == 2:
        asm: tl.constexpr = REFINED_ASM_2
    else:
        asm: tl.constexpr = REFINED_ASM_3
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


# ----- decode 1, first programs: threshold ----------------------------------------------------

@triton.jit
def _pseudo_max_part(Q, K, V, KMAP, CODES, SCALES, RES, BT, PM, b, hk, z, L,
                     stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                     scale_log2, sink, window,
                     SINK_PARTS: tl.constexpr, NUM_PARTS: tl.constexpr, NUM_HEADS: tl.constexpr,
                     NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                     D4: tl.constexpr, BS: tl.constexpr, SLICE: tl.constexpr, UPCAST: tl.constexpr,
                     HAS_KMAP: tl.constexpr):
    """Slice z % SLICES (SLICE tokens) of part z // SLICES of the pseudo-max of (sequence b, KV head
    hk): part p < SINK_PARTS is sink block p, then the window's blocks, the last part the exact tail.
    It writes the row max over its tokens in the sinks or the window to PM[b, head, z]. Slices keep
    each program's tiles small: these programs share the scan's one-warp launch. Rows below
    min_ffd_len never get here (`_scan_kernel` returns first)."""
    SLICES: tl.constexpr = BS // SLICE
    part = z // SLICES
    sl = z % SLICES
    nq = L // BS
    rows = tl.arange(0, BLOCK_H)
    toks = sl * SLICE + tl.arange(0, SLICE)
    best = tl.full([BLOCK_H], float("-inf"), tl.float32)
    q, q0, q1, q2, q3 = _load_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP, BLOCK_H, D, D4, UPCAST)
    bt_row = BT + b.to(tl.int64) * stride_bt
    if part == NUM_PARTS - 1:
        page = tl.load(bt_row + nq, mask=nq * BS < L, other=0).to(tl.int64)   # the tail may be empty
        valid = nq * BS + toks < L
        k = _token_rows(K, key_page(KMAP, page, HAS_KMAP), hk, toks, stride_kb, stride_kt, stride_kh, valid, D,
                        UPCAST)
        ok = valid & _in_window(nq * BS + toks, L, sink, window)
        best = tl.max(tl.where(ok[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf")), 1)
    else:
        sink_blocks = tl.minimum(tl.cdiv(sink, BS), nq)
        first_window = tl.maximum(tl.maximum(L - window, 0) // BS, sink_blocks)
        blk = tl.where(part < SINK_PARTS, part, first_window + part - SINK_PARTS)
        useful = tl.where(part < SINK_PARTS, blk < sink_blocks, blk < nq)
        if useful:
            page = tl.load(bt_row + blk)
            zs = _quant_scores(q0, q1, q2, q3, CODES, SCALES, RES, page, hk, sl, NUM_KV_HEADS, BLOCK_H, SLICE,
                               SLICES, D, D4, True, UPCAST) * scale_log2
            best = tl.max(tl.where(_in_window(blk * BS + toks, L, sink, window)[None, :], zs, float("-inf")), 1)
    heads = hk * GROUP + rows
    tl.store(PM + ((b.to(tl.int64) * NUM_HEADS + heads) * (NUM_PARTS * SLICES) + z), best, mask=rows < GROUP)


@triton.jit
def _wait_for(counter, target):
    """Spin until *counter >= target (acquire at GPU scope), then let the whole program read what the
    counting programs wrote before their release."""
    seen = tl.atomic_add(counter, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire")
    tl.debug_barrier()


# ----- decode 1, the other programs: 2-bit scan -> keep flags ---------------------------------

@triton.jit
def _load_qt_plane(Q, b, hk, stride_qb, stride_qh, j: tl.constexpr, GROUP: tl.constexpr, SCAN_N: tl.constexpr,
                   D4: tl.constexpr):
    """Channel plane j of the q rows of KV head hk, transposed and in fp32: [D/4, SCAN_N] (columns
    >= GROUP are 0)."""
    cols = tl.arange(0, SCAN_N)
    return tl.load(Q + b.to(tl.int64) * stride_qb + (hk * GROUP + cols)[None, :] * stride_qh + j * D4
                   + tl.arange(0, D4)[:, None], mask=(cols < GROUP)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _scan_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP: tl.constexpr, SCAN_N: tl.constexpr, D4: tl.constexpr,
                 UPCAST: tl.constexpr):
    """The scan's q side of KV head hk: four transposed planes [D/4, SCAN_N] and q_unit [SCAN_N].
    GPU: each row divided by q_unit = max |q row| / 127, so |q / q_unit| <= 127 (the int8 range of
    `_scan_block_max`); interpreter: q itself and q_unit = 1."""
    qa0 = _load_qt_plane(Q, b, hk, stride_qb, stride_qh, 0, GROUP, SCAN_N, D4)
    qa1 = _load_qt_plane(Q, b, hk, stride_qb, stride_qh, 1, GROUP, SCAN_N, D4)
    qa2 = _load_qt_plane(Q, b, hk, stride_qb, stride_qh, 2, GROUP, SCAN_N, D4)
    qa3 = _load_qt_plane(Q, b, hk, stride_qb, stride_qh, 3, GROUP, SCAN_N, D4)
    q_unit = tl.full([SCAN_N], 1.0, tl.float32)
    if not UPCAST:
        q_unit = tl.maximum(tl.maximum(tl.max(tl.abs(qa0), 0), tl.max(tl.abs(qa1), 0)),
                            tl.maximum(tl.max(tl.abs(qa2), 0), tl.max(tl.abs(qa3), 0))) / INT8_Q_MAX
        inv = 1.0 / tl.maximum(q_unit, 1e-30)          # zero rows (padding) stay zero
        qa0, qa1, qa2, qa3 = qa0 * inv[None, :], qa1 * inv[None, :], qa2 * inv[None, :], qa3 * inv[None, :]
    return qa0, qa1, qa2, qa3, q_unit


@triton.jit
def _scan_plane(byte, j: tl.constexpr):
    """Code plane j of a uint8 code tile as int8 lanes 0..3 (`scan_plane_asm`; GPU only)."""
    return _plane_of(byte, j, SCAN_ASM_0, SCAN_ASM_1, SCAN_ASM_2, SCAN_ASM_3, True)


@triton.jit
def _int8_q_side(qt, sn):
    """round(qt * sn) [BPP, D/4, SCAN_N] (|qt * sn| <= 127) as int8 and as int32: one fma adds
    INT_ROUND, the rounded value is the low bits (no conversion instruction)."""
    v = (qt[None, :, :] * sn[:, :, None] + INT_ROUND).to(tl.int32, bitcast=True) - INT_ROUND_BITS
    return v.to(tl.int8), v


@triton.jit
def _scan_step_loads(CODES, SCALES, bt_row, blks, ok, hk, NUM_KV_HEADS: tl.constexpr, BS: tl.constexpr,
                     D: tl.constexpr, D4: tl.constexpr):
    """Every load of one scan step, issued before any math: the page ids of the BPP blocks `blks`
    (0 where not ok), then their four channel-range scales [BPP, D/4] and codes [BPP, BS, D/4]
    (returned)."""
    pages = tl.load(bt_row + blks, mask=ok, other=0).to(tl.int64)
    qbase = pages * NUM_KV_HEADS + hk                                          # [BPP]
    cols = tl.arange(0, D4)
    sptr = SCALES + qbase[:, None] * D + cols[None, :]                         # [BPP, D4]
    s0 = tl.load(sptr + 0 * D4, mask=ok[:, None], other=0.0)
    s1 = tl.load(sptr + 1 * D4, mask=ok[:, None], other=0.0)
    s2 = tl.load(sptr + 2 * D4, mask=ok[:, None], other=0.0)
    s3 = tl.load(sptr + 3 * D4, mask=ok[:, None], other=0.0)
    toks = tl.arange(0, BS)
    byte = tl.load(CODES + (qbase[:, None, None] * BS + toks[None, :, None]) * D4 + cols[None, None, :],
                   mask=ok[:, None, None], other=0)                            # [BPP, BS, D4]
    return s0, s1, s2, s3, byte


@triton.jit
def _scan_block_max(qt0, qt1, qt2, qt3, q_unit, CODES, SCALES, bt_row, blks, ok, hk, scale_log2, BPP: tl.constexpr,
                    NUM_KV_HEADS: tl.constexpr, SCAN_N: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                    D4: tl.constexpr, UPCAST: tl.constexpr, SUM_BY_MMA: tl.constexpr):
    """Each row's 2-bit block max (log2 units) [BPP, SCAN_N] of the BPP blocks `blks`.

    q.(2-bit key) as in `_quant_scores(..., REFINE=False)`, batched over the blocks (3-D dots) and
    transposed: [BS, D/4] x [D/4, SCAN_N] per plane, so the MMA pads the G query rows to 8, not 16,
    and the codes are the A operand, which the compiler expands in registers. The max over tokens is
    taken before the (monotone) scaling: same result, 1/BS of the work.

    GPU: int8 MMA (m16n8k32: four codes per register, one K-step per plane). The codes are int8
    lanes 0..3 (`scan_plane_asm`); the q side is round(q' s / s_max), q' = q / q_unit
    (`_scan_rows_q`) and s_max the block's largest channel scale, so it is within [-127, 127]. The
    int32 dot minus 1.5 * the sum of the rounded q side is exactly the level dot of the rounded q
    side, scaled back by q_unit * s_max. SUM_BY_MMA: that sum is an int8 MMA of an all-ones operand
    with the q side (every one of its 16 rows is the sum, exact), 4 more IMMA instead of the q side
    recomputed in a second register layout and reduced over the channels (Triton 3.6, sm_90: 525
    instead of 579 instructions per step; `scan_sum_by_mma` says where it is faster). Interpreter: the exact levels
    in fp32 (q_unit = 1)."""
    s0, s1, s2, s3, byte = _scan_step_loads(CODES, SCALES, bt_row, blks, ok, hk, NUM_KV_HEADS, BS, D, D4)
    if UPCAST:
        raw = tl.zeros([BPP, BS, SCAN_N], tl.float32)                         # q.k over [BPP, tokens, rows]
        raw = tl.dot(_code_plane(byte, 0, UPCAST), qt0[None, :, :] * s0[:, :, None], raw, input_precision="ieee")
        raw = tl.dot(_code_plane(byte, 1, UPCAST), qt1[None, :, :] * s1[:, :, None], raw, input_precision="ieee")
        raw = tl.dot(_code_plane(byte, 2, UPCAST), qt2[None, :, :] * s2[:, :, None], raw, input_precision="ieee")
        raw = tl.dot(_code_plane(byte, 3, UPCAST), qt3[None, :, :] * s3[:, :, None], raw, input_precision="ieee")
        return tl.max(raw, 1) * scale_log2
    s_max = tl.max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)), 1)      # [BPP]; masked blocks: s = 0
    # 1 / s_max to 1 ulp (one MUFU.RCP, not IEEE division): |q side| <= 127 (1 + 2^-23) still rounds to 127
    inv = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [tl.maximum(s_max, 1e-30)],
                                    dtype=tl.float32, is_pure=True, pack=1)
    i0, v0 = _int8_q_side(qt0, s0 * inv[:, None])
    i1, v1 = _int8_q_side(qt1, s1 * inv[:, None])
    i2, v2 = _int8_q_side(qt2, s2 * inv[:, None])
    i3, v3 = _int8_q_side(qt3, s3 * inv[:, None])
    if SUM_BY_MMA:   # four independent dots: no chain in front of the block max
        ones = tl.full([BPP, 16, D4], 1, tl.int8)
        zero = tl.zeros([BPP, 16, SCAN_N], tl.int32)
        q_sum = tl.max(tl.dot(ones, i0, zero, out_dtype=tl.int32) + tl.dot(ones, i1, zero, out_dtype=tl.int32)
                       + tl.dot(ones, i2, zero, out_dtype=tl.int32) + tl.dot(ones, i3, zero, out_dtype=tl.int32), 1)
    else:
        q_sum = tl.sum(v0 + v1 + v2 + v3, 1)
    acc = tl.zeros([BPP, BS, SCAN_N], tl.int32)
    acc = tl.dot(_scan_plane(byte, 0), i0, acc, out_dtype=tl.int32)
    acc = tl.dot(_scan_plane(byte, 1), i1, acc, out_dtype=tl.int32)
    acc = tl.dot(_scan_plane(byte, 2), i2, acc, out_dtype=tl.int32)
    acc = tl.dot(_scan_plane(byte, 3), i3, acc, out_dtype=tl.int32)
    twice = 2 * tl.max(acc, 1) - 3 * q_sum                                     # 2 (dot - 1.5 sum): exact
    return twice.to(tl.float32) * (0.5 * s_max)[:, None] * q_unit[None, :] * scale_log2


@triton.jit
def _scan_block_max_rows(q0, q1, q2, q3, CODES, SCALES, bt_row, blks, ok, hk, scale_log2, BPP: tl.constexpr,
                         NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                         D4: tl.constexpr, UPCAST: tl.constexpr):
    """`_scan_block_max` with the query rows as the dots' M (padded to 16) and the exact levels: for
    head_dim 64, where a plane is only 16 channels deep and the transposed form's codes would go
    through shared memory as bf16 (twice the instructions, measured)."""
    s0, s1, s2, s3, byte = _scan_step_loads(CODES, SCALES, bt_row, blks, ok, hk, NUM_KV_HEADS, BS, D, D4)
    raw = tl.zeros([BPP, BLOCK_H, BS], tl.float32)                            # q.k over [BPP, rows, tokens]
    raw = _plane_term(raw, q0.to(tl.float32)[None, :, :] * s0[:, None, :],
                      tl.permute(_code_plane(byte, 0, UPCAST), (0, 2, 1)), False, UPCAST)
    raw = _plane_term(raw, q1.to(tl.float32)[None, :, :] * s1[:, None, :],
                      tl.permute(_code_plane(byte, 1, UPCAST), (0, 2, 1)), False, UPCAST)
    raw = _plane_term(raw, q2.to(tl.float32)[None, :, :] * s2[:, None, :],
                      tl.permute(_code_plane(byte, 2, UPCAST), (0, 2, 1)), False, UPCAST)
    raw = _plane_term(raw, q3.to(tl.float32)[None, :, :] * s3[:, None, :],
                      tl.permute(_code_plane(byte, 3, UPCAST), (0, 2, 1)), False, UPCAST)
    return tl.max(raw, 2) * scale_log2


@triton.jit
def _keep_decisions(bmax_row, th, bt_row, flag_row, mask_row, prog, programs, steps, nq, sink_blocks, forced_hi,
                    BPP: tl.constexpr, SCAN_N: tl.constexpr, BS: tl.constexpr, CHUNK: tl.constexpr,
                    WRITE_MASK: tl.constexpr):
    """Keep decisions of a scan program's blocks (steps prog, prog + programs, ...) from their stored
    block maxes, CHUNK steps per vector: the flag is the page id of a kept block, -1 of a dropped one
    (so the attend pass reads no block table). Returns the kept count."""
    k = tl.arange(0, CHUNK * BPP)                       # (step, block of the step), flattened
    cols = tl.arange(0, SCAN_N)
    n_kept = nq * 0
    for c in range(0, tl.cdiv(steps - prog, programs), CHUNK):
        step = prog + (c + k // BPP) * programs
        blks = step * BPP + k % BPP
        ok = (step < steps) & (blks < nq)
        bmax = tl.load(bmax_row + blks[:, None] * SCAN_N + cols[None, :], mask=ok[:, None], other=float("-inf"))
        hit = tl.max(tl.where(bmax >= th[None, :], 1, 0), 1)
        keep = (hit > 0) | (blks < sink_blocks) | ((blks + 1) * BS > forced_hi)
        pages = tl.load(bt_row + blks, mask=ok, other=0)
        tl.store(flag_row + blks, tl.where(keep, pages, -1).to(tl.int32), mask=ok)
        n_kept += tl.sum((keep & ok).to(tl.int32), 0)
        if WRITE_MASK:   # test output: the keep decision of every full block
            tl.store(mask_row + blks, keep.to(tl.int8), mask=ok)
    return n_kept


@triton.jit
def _scan_kernel(Q, K, V, KMAP, CODES, SCALES, RES, BT, SEQ, PM, BMAX, FLAGS, MASK, SYNC,
                 stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_mask, max_blocks,
                 scale_log2, delta_log2, sink, window, min_ffd_len,
                 BPP: tl.constexpr, SINK_PARTS: tl.constexpr, NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
                 NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                 D: tl.constexpr, D4: tl.constexpr, BS: tl.constexpr, UPCAST: tl.constexpr, HAS_KMAP: tl.constexpr,
                 WRITE_MASK: tl.constexpr, SCAN_N: tl.constexpr, TOKENS_AS_M: tl.constexpr, SUM_BY_MMA: tl.constexpr,
                 PM_SLICE: tl.constexpr, DECIDE_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Threshold and keep decisions of (sequence, KV head) in one launch. Programs z < PM_PROGRAMS
    (NUM_PARTS * BS / PM_SLICE) are the pseudo-max slices (`_pseudo_max_part`); each then counts
    itself in the row's READY counter. Scan program p = z - PM_PROGRAMS takes the BPP-block steps
    p, p + P, ... (P scan programs per row) and stores each block's per-row 2-bit max in BMAX, which
    needs no threshold; only then does it wait for READY = PM_PROGRAMS (the slices are the grid's
    lowest program ids, so they are dispatched first, and their few tokens take far less time than a
    scan program's loop), take th = max over the slices - δ and turn its stored maxes into keep
    flags. SYNC (int32, zero between calls): [kept-block total, READY per row, DONE per row]; the
    row's last scan program to finish zeroes its READY and DONE, the merge zeroes the total."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    z = tl.program_id(2)
    PM_PROGRAMS: tl.constexpr = NUM_PARTS * (BS // PM_SLICE)
    _release_next(PDL)
    L = tl.load(SEQ + b)
    if L < min_ffd_len:     # "auto", a dense row: the attend reads nothing of this launch for it
        return
    row = b.to(tl.int64) * NUM_KV_HEADS + hk
    ready = SYNC + 1 + row
    done = SYNC + 1 + tl.num_programs(0) * NUM_KV_HEADS + row
    if z < PM_PROGRAMS:
        _pseudo_max_part(Q, K, V, KMAP, CODES, SCALES, RES, BT, PM, b, hk, z, L,
                         stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                         scale_log2, sink, window, SINK_PARTS, NUM_PARTS, NUM_HEADS, NUM_KV_HEADS,
                         GROUP, BLOCK_H, D, D4, BS, PM_SLICE, UPCAST, HAS_KMAP)
        tl.debug_barrier()                      # every thread's PM store before the release
        tl.atomic_add(ready, 1, sem="release")
    else:
        prog = z - PM_PROGRAMS
        programs = tl.num_programs(2) - PM_PROGRAMS
        nq = L // BS                              # full blocks (dense rows returned above)
        steps = tl.cdiv(nq, BPP)
        cols = tl.arange(0, SCAN_N)
        bt_row = BT + b.to(tl.int64) * stride_bt
        bmax_row = BMAX + row * max_blocks * SCAN_N
        if prog < steps:
            if TOKENS_AS_M:
                qa0, qa1, qa2, qa3, q_unit = _scan_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP, SCAN_N, D4, UPCAST)
            else:
                qa0, qa1, qa2, qa3 = _load_q_planes(Q, b, hk, stride_qb, stride_qh, GROUP, SCAN_N, D4, UPCAST)
            for step in range(prog, steps, programs):
                blks = step * BPP + tl.arange(0, BPP)
                ok = blks < nq
                if TOKENS_AS_M:
                    bmax = _scan_block_max(qa0, qa1, qa2, qa3, q_unit, CODES, SCALES, bt_row, blks, ok, hk, scale_log2,
                                           BPP, NUM_KV_HEADS, SCAN_N, BS, D, D4, UPCAST, SUM_BY_MMA)
                else:
                    bmax = _scan_block_max_rows(qa0, qa1, qa2, qa3, CODES, SCALES, bt_row, blks, ok, hk,
                                                scale_log2, BPP, NUM_KV_HEADS, SCAN_N, BS, D, D4, UPCAST)
                tl.store(bmax_row + blks[:, None] * SCAN_N + cols[None, :], bmax, mask=ok[:, None])
        _wait_for(ready, PM_PROGRAMS)             # also orders this program's BMAX stores before the reads
        if prog < steps:
            heads = hk * GROUP + cols
            parts = tl.arange(0, PARTS_PAD)
            pm = tl.load(PM + (b.to(tl.int64) * NUM_HEADS + heads)[:, None] * PM_PROGRAMS + parts[None, :],
                         mask=(cols < GROUP)[:, None] & (parts < PM_PROGRAMS)[None, :], other=float("-inf"),
                         cache_modifier=".cg")
            th = tl.where(cols < GROUP, tl.max(pm, 1) - delta_log2, float("inf"))    # padding rows keep nothing
            sink_blocks = tl.minimum(tl.cdiv(sink, BS), nq)
            forced_hi = tl.maximum(L - window, 0)                                # blocks ending after this: window
            n_kept = _keep_decisions(bmax_row, th, bt_row, FLAGS + row * max_blocks, MASK + row * stride_mask,
                                     prog, programs, steps, nq, sink_blocks, forced_hi, BPP, SCAN_N, BS,
                                     DECIDE_CHUNK, WRITE_MASK)
            tl.atomic_add(SYNC, n_kept)
        if tl.atomic_add(done, 1, sem="acq_rel") == programs - 1:    # the row's last: every program is past
            tl.store(ready, 0)                                          # its wait, the parts are counted
            tl.store(done, 0)


# ----- decode 2: attend over the kept blocks -------------------------------------------------

@triton.jit
def _flag_chunk(flag_row, c, nq, CHUNK: tl.constexpr):
    """Chunk c of a (sequence, KV head)'s flag row: page ids (-1 = dropped or past nq), keep 1/0."""
    idx = c * CHUNK + tl.arange(0, CHUNK)
    page = tl.load(flag_row + idx, mask=idx < nq, other=-1)
    return page, (page >= 0).to(tl.int32)


@triton.jit
def _scatter_mine(page, keep, base, lo, n_mine, slot_row):
    """slot_row[r - lo] = page of the kept block of rank r, for r in [lo, lo + n_mine); ranks are
    exclusive prefix sums of the keep flags (base: kept blocks before this chunk), so the kept
    blocks keep their order."""
    rank = base + tl.cumsum(keep, 0) - keep
    mine = (keep > 0) & (rank >= lo) & (rank < lo + n_mine)
    tl.store(slot_row + (rank - lo), page, mask=mine)


@triton.jit
def _kept_block(q0, q1, q2, q3, CODES, SCALES, RES, V, page, hk, stride_kb, stride_kt, stride_kh,
                NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                D4: tl.constexpr, UPCAST: tl.constexpr):
    """Refined raw scores [BLOCK_H, BS] and the V tile of one kept block; all loads go out first."""
    qbase = page * NUM_KV_HEADS + hk
    s0, s1, s2, s3 = _load_scales(SCALES, qbase, D, D4)
    byte = _load_codes(CODES, qbase, BS, D4)
    r0, r1, r2, r3 = _load_residual(RES, qbase, BS, D, D4)
    v = _page_tile(V, page, hk, stride_kb, stride_kt, stride_kh, tl.arange(0, BS) < BS, BS, D, UPCAST)
    return _refined_dots(q0, q1, q2, q3, s0, s1, s2, s3, byte, r0, r1, r2, r3, BLOCK_H, BS, UPCAST), v


@triton.jit
def _attend_kernel(Q, K, V, KMAP, CODES, SCALES, RES, BT, SEQ, FLAGS, SLOTS, P_ACC, P_ML, STATS, KEPT_TOTAL,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, max_blocks,
                   scale_log2, min_ffd_len, resident,
                   NUM_SPLITS: tl.constexpr, MIN_PER_SPLIT: tl.constexpr, DENSE_MIN_PER_SPLIT: tl.constexpr,
                   PER_MAX: tl.constexpr,
                   FLAG_CHUNK: tl.constexpr, ONE_CHUNK: tl.constexpr, NUM_HEADS: tl.constexpr,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                   D4: tl.constexpr, BS: tl.constexpr, UPCAST: tl.constexpr, COUNT: tl.constexpr,
                   HAS_KMAP: tl.constexpr, PDL: tl.constexpr):
    """Partial (m, l, acc) of one split. Kept blocks: ranks [split * per, split * per + n_mine) with
    per = max(ceil(kept / NUM_SPLITS), MIN_PER_SPLIT, min(ceil(KEPT_TOTAL / resident), PER_MAX))
    <= PER_MAX (see `attend_slots`), so the splits cover every kept block exactly once. The last
    term (resident > 0) makes the batch's busy splits one round: with resident = the programs the
    GPU runs at once minus the rows (B * Hkv), sum over rows of ceil(kept / per) <= KEPT_TOTAL / per
    + rows <= the programs the GPU runs at once. "auto" rows below the crossover: pages
    [split * per, (split + 1) * per) of the exact keys instead. ONE_CHUNK: the whole flag row fits
    one FLAG_CHUNK load, read once for both the count and the ranks."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    _release_next(PDL)
    L = tl.load(SEQ + b)
    dense = L < min_ffd_len
    nq = _quantized_len(L, min_ffd_len, BS)
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < GROUP
    heads = hk * GROUP + rows
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_bt
    row = b.to(tl.int64) * NUM_KV_HEADS + hk
    # q first: its loads overlap the flag row's instead of following the split's work decision
    q, q0, q1, q2, q3 = _load_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP, BLOCK_H, D, D4, UPCAST)
    _wait_previous(PDL)                         # the scan's flags and kept-block total
    if dense:
        # "auto" below the crossover: dense split-KV over the exact keys (Flash-Decoding)
        pages = tl.cdiv(L, BS)
        per = tl.maximum(tl.cdiv(pages, NUM_SPLITS), DENSE_MIN_PER_SPLIT)
        lo = split * per
        hi = tl.minimum(lo + per, pages)
        for blk in range(lo, hi):
            raw, v, valid = _exact_tile(q, K, V, KMAP, bt_row, blk, L, hk, stride_kb, stride_kt, stride_kh, BS, D,
                                        UPCAST, HAS_KMAP)
            m, l, acc = _online(m, l, acc, tl.where(valid[None, :], raw * scale_log2, float("-inf")), v)
    else:
        flag_row = FLAGS + row * max_blocks
        if ONE_CHUNK:
            page_row, keep_row = _flag_chunk(flag_row, 0, nq, FLAG_CHUNK)
            kept = tl.sum(keep_row, 0)
        else:
            kept = nq * 0
            for c in range(tl.cdiv(nq, FLAG_CHUNK)):
                kept += tl.sum(_flag_chunk(flag_row, c, nq, FLAG_CHUNK)[1], 0)
        per = tl.maximum(tl.cdiv(kept, NUM_SPLITS), MIN_PER_SPLIT)
        if resident > 0:
            per = tl.maximum(per, tl.minimum(tl.cdiv(tl.load(KEPT_TOTAL), resident), PER_MAX))
        lo = split * per
        n_mine = tl.minimum(tl.maximum(kept - lo, 0), per)
        if n_mine > 0:
            slot_row = SLOTS + (row * NUM_SPLITS + split) * PER_MAX
            if ONE_CHUNK:
                _scatter_mine(page_row, keep_row, 0, lo, n_mine, slot_row)
            else:
                base = nq * 0
                for c in range(tl.cdiv(nq, FLAG_CHUNK)):
                    page_c, keep_c = _flag_chunk(flag_row, c, nq, FLAG_CHUNK)
                    _scatter_mine(page_c, keep_c, base, lo, n_mine, slot_row)
                    base += tl.sum(keep_c, 0)
            tl.debug_barrier()                          # the slot row was written by other threads
            slots = tl.arange(0, PER_MAX)
            my_pages = tl.load(slot_row + slots, mask=slots < n_mine, other=0)
            for i in range(n_mine):                     # no data-dependent branch inside
                page = tl.sum(tl.where(slots == i, my_pages, 0), 0).to(tl.int64)
                raw, v = _kept_block(q0, q1, q2, q3, CODES, SCALES, RES, V, page, hk, stride_kb, stride_kt,
                                     stride_kh, NUM_KV_HEADS, BLOCK_H, BS, D, D4, UPCAST)
                m, l, acc = _online(m, l, acc, raw * scale_log2, v)
        if (split == NUM_SPLITS - 1) & (L > nq * BS):   # the exact tail, once per sequence
            raw, v, valid = _exact_tile(q, K, V, KMAP, bt_row, nq, L, hk, stride_kb, stride_kt, stride_kh, BS, D,
                                        UPCAST, HAS_KMAP)
            m, l, acc = _online(m, l, acc, tl.where(valid[None, :], raw * scale_log2, float("-inf")), v)
        if COUNT:   # once per (sequence, KV head)
            tl.atomic_add(STATS, nq.to(tl.int64), mask=split == 0)
            tl.atomic_add(STATS + 1, kept.to(tl.int64), mask=split == 0)
    part = (b.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
    tl.store(P_ML + part * 2, m, mask=row_ok)
    tl.store(P_ML + part * 2 + 1, l, mask=row_ok)
    # an empty split's acc is never read (the merge masks it by m = -inf): no store
    tl.store(P_ACC + part[:, None] * D + tl.arange(0, D)[None, :], acc,
             mask=(row_ok & (m > float("-inf")))[:, None])


# ----- decode 3: merge -----------------------------------------------------------------------

@triton.jit
def _merge_kernel(OUT, P_ACC, P_ML, KEPT_TOTAL, stride_ob, stride_oh, NUM_SPLITS: tl.constexpr,
                  NUM_HEADS: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, PDL: tl.constexpr):
    """Log-sum-exp merge of one (sequence, query head)'s splits over channels [c * DC, (c + 1) * DC).

    All splits at once (one round trip for m, l, one for acc); empty splits (m = -inf) weigh 0 and
    their acc is not read. A row with no token at all (L = 0) gets 0. Program (0, 0, 0) zeroes the
    kept-block total for the next call (the attend, its last reader, has finished)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    base = (b.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS
    _wait_previous(PDL)
    tl.store(KEPT_TOTAL, 0, mask=(b == 0) & (h == 0) & (c == 0))
    s = base + tl.arange(0, NUM_SPLITS)
    m_s = tl.load(P_ML + s * 2)
    l_s = tl.load(P_ML + s * 2 + 1)
    used = m_s > float("-inf")
    m_all = tl.max(m_s, 0)
    w = tl.where(used, tl.exp2(m_s - tl.where(m_all > float("-inf"), m_all, 0.0)), 0.0)
    l_all = tl.sum(w * l_s, 0)
    cols = c * DC + tl.arange(0, DC)
    a = tl.load(P_ACC + s[:, None] * D + cols[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(a * w[:, None], 0) / tl.where(l_all > 0, l_all, 1.0)
    tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + cols, out.to(OUT.dtype.element_ty))


# ----- host side ---------------------------------------------------------------------------------

SCAN_PROGRAMS_PER_SM = 8     # scan grid size (choose_splits): H200 sweeps in bench/RESULTS.md
ATTEND_PROGRAMS_PER_SM = 8   # attend grid size
# Fewest kept blocks an attend split takes, and fewest pages for "auto"'s dense rows. H200, 1 against 2
# (results/ffd_min_per_split.json): kept blocks B = 1, 16K 24.4 against 26.8 us, the same elsewhere (long
# rows get several per split from the resident term); dense rows B = 1 21.8 against 20.9 (4K), 33.6
# against 32.3 (16K), B = 8 the same.
MIN_PER_SPLIT = 1
DENSE_MIN_PER_SPLIT = 2
# Scan step shape, H200 sweeps (bench/RESULTS.md): one block per step on one warp, 4 programs per SM and a
# 6-deep pipeline beat 2 blocks on 2 warps with 2 programs per SM (B = 8, 128K: 262.4 vs 269.8 us; B = 1,
# 256K: 84.9 vs 86.0) and 4 blocks on 4 warps; more warps per block (4 warps, 2 blocks: 402.5) lose.
# 8 programs per SM then: B = 8, 128K 253.4 vs 262.6 (16: 250.8, but 16K slower), B = 1 the same.
SCAN_BLOCKS_PER_STEP = 1   # BPP: [BPP, BS, D/4] codes and [BPP, BS, G] scores in registers
SCAN_WARPS = 1
SCAN_STAGES = 6         # H200: 6 beat 3, 4, 8 and 10 (B = 1, 256K: 100.0 vs 105.9 us; B = 8, 128K: 278.6 vs 300.4)
# The scan's transposed dots (tokens as M) from this head_dim up: at D = 64 a code plane is 16 channels, too
# shallow for the compiler to expand the codes in registers (sm_90 SASS: 1561 against 796 instructions per step).
SCAN_TOKENS_AS_M_MIN_DIM = 128
# The scan's sum of its int8 q side by an MMA (`_scan_block_max`) where its grid is more than the
# SCAN_PROGRAMS_PER_SM programs per SM that run at once, i.e. where the scan is bound by instruction
# throughput; where it is one wave each program's step latency matters more. H200, side by side
# (results/ffd_scan_sum_forms.json, run 2): B = 8, 128K, f = 0.02 130.6 -> 125.7 us, 64K 116.4 -> 111.8; B = 1,
# 128K 44.3 against 44.5, 256K 67.5 against 71.0; and in the one-wave grid (SCAN_WAVE_MIN_STEPS). None: by those
# rules; True / False: always / never (False also keeps the default grid).
SCAN_SUM_BY_MMA: bool | None = None
# A scan grid under one wave of the MMA-sum form (head_dim >= SCAN_TOKENS_AS_M_MIN_DIM; B = 1 at
# Llama-3.1-8B shapes) becomes one full wave of it
# (12 programs per SM at 164 registers: 182 scan programs per row instead of 128) where its programs would
# take at least this many block steps. H200, side by side (results/ffd_scan_one_wave.json), B = 1: 128K 44.6 ->
# 42.6 us, 256K 67.6 -> 64.9; at 64K (4 steps -> 3) 34.0 against 34.1, no gain, hence the floor.
SCAN_WAVE_MIN_STEPS = 8
FLAG_CHUNK = 4096       # flags per prefix-sum step of the attend kernel: one step up to 512K tokens at BS 128
PM_SLICE = 32           # tokens per pseudo-max program: [16, 32] tiles fit the scan's one warp unspilled
DECIDE_CHUNK = 64       # scan steps whose keep decisions one vector takes (B = 1, 256K: 16 per program)
MERGE_TILE = 4096       # fp32 partial elements one merge program holds: [splits, channels]


def choose_splits(batch: int, num_kv_heads: int, device: torch.device, per_sm: int = 8) -> int:
    """About `per_sm` programs per SM at this batch size, a power of two <= 128 (B only: graph-safe).

    The attend grid uses ATTEND_PROGRAMS_PER_SM: several waves of programs (`attend_resident_per_sm`
    fit an SM at once) spread one long sequence of a skewed batch over the whole GPU, and a sequence's attend
    splits get at least MIN_PER_SPLIT kept blocks each, the rest exit at once. The scan grid uses
    SCAN_PROGRAMS_PER_SM: its programs walk their blocks in a grid-stride loop, so any count covers
    every block."""
    target = per_sm * num_compute_units(device)
    return min(128, triton.next_power_of_2(max(1, math.ceil(target / max(1, batch * num_kv_heads)))))


def scan_sum_by_mma(scan_programs: int, compute_units: int) -> bool:
    """Whether the scan sums its int8 q side by an MMA (SCAN_SUM_BY_MMA)."""
    if SCAN_SUM_BY_MMA is not None:
        return SCAN_SUM_BY_MMA
    return scan_programs > SCAN_PROGRAMS_PER_SM * compute_units


def attend_slots(max_blocks: int, splits: int, min_per: int) -> int:
    """PER_MAX, the page-id slots of one attend split: a power of two >= max(ceil(max_blocks /
    splits), min_per).

    Why no kept block is ever dropped: a sequence has kept <= nq <= max_blocks kept blocks, and
    each split takes per = max(ceil(kept / splits), min_per, min(balance, PER_MAX)) of them (balance:
    the batch's share per resident program, any value), so
      per <= max(ceil(max_blocks / splits), min_per, PER_MAX) = PER_MAX  (every split fits its slots),
      splits * per >= kept                                               (the ranges cover all ranks);
    the ranges [s * per, (s + 1) * per) are disjoint, so each kept block is attended exactly once.
    """
    return triton.next_power_of_2(max(1, -(-max_blocks // splits), min_per))


def attend_stages(block_size: int, head_dim: int) -> int:
    """Pipeline depth of the attend loop: 3 where two programs still share an SM's 228 KB of shared
    memory (BS * D <= 128 * 128: 113 KB each on sm_90), else 2. H200, B = 8, 128K: 265.0 against
    274.0 us; B = 1, 256K: 86.9 against 89.3."""
    return 3 if block_size * head_dim <= 128 * 128 else 2


def attend_resident_per_sm(args: tuple, kwargs: dict, q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Attend programs one SM runs at once, from the compiled kernel's registers and shared memory
    (`kernels.occupancy`, once per specialisation). Compiled for sm_90: 2 at the default pages (255
    registers, 113 KB of shared memory), 3 at head_dim 64, 1 at 256-token pages. 2 in the
    interpreter, which has no SMs."""
    if q.device.type != "cuda":
        return 2
    key = ("ffd_attend", q.dtype, k_cache.dtype, tuple(kwargs.items()))   # built in a fixed order
    return resident_ctas(_attend_kernel, key, (*args, 0), kwargs, q.device)


def sync_entries(batch: int, kv_heads: int) -> int:
    """int32 counters one decode launch uses: the kept-block total, then READY and DONE per (sequence,
    KV head)."""
    return 1 + 2 * batch * kv_heads


def ffd_sync_buffer(batch: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """Zeroed counters for `ffd_decode` calls of up to `batch` sequences: each call leaves them zero, so
    a caller that keeps one per stream pays no memset per call (calls on other streams need their own)."""
    return torch.zeros(sync_entries(batch, kv_heads), dtype=torch.int32, device=device)


def check_ffd_inputs(what: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, params: FFDParams) -> None:
    """Raise for shapes and layouts the FFD kernels do not serve (q [T, Hq, D], pages [N, BS, Hkv, D])."""
    num_heads, dim = q.shape[1:]
    _, bs, kv_heads, _ = k_cache.shape
    if bs != params.block_size:
        raise ValueError(f"KV page size {bs} != ffd block size {params.block_size}")
    if dim not in (64, 128, 256) or k_cache.shape[3] != dim:
        raise ValueError(f"FFD's Triton kernels serve head_dim 64, 128 or 256 (D/4 >= 16 for tl.dot); got {dim}")
    if num_heads % kv_heads or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError(f"{what}: Hq must be a multiple of Hkv, K/V pages must share strides, "
                         "and head dims must be contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables and seq_lens must be int32, block_tables rows contiguous")


def ffd_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, codes: torch.Tensor,
               scales: torch.Tensor, residual: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               *, scale: float, params: FFDParams, num_splits: int | None = None,
               stats: torch.Tensor | None = None, out: torch.Tensor | None = None,
               masks: torch.Tensor | None = None, key_page_map: torch.Tensor | None = None,
               resident_programs: int | None = None, pdl: bool | None = None,
               sync: torch.Tensor | None = None) -> torch.Tensor:
    """q[B, Hq, D] -> out[B, Hq, D] under the FFD rule (decode: one query per sequence).

    k/v_cache [N, BS, Hkv, D] exact pages; codes/scales/residual the same pages quantized
    (`kernels.ffd_reference`). With `key_page_map` (int32 [N]) k_cache is a smaller pool and the
    exact keys of page p are its page key_page_map[p] (only the tails are read). `stats` (int64 [2],
    optional) += (full blocks, kept blocks) over (sequence, KV head) pairs; `masks` (int8 [B, Hkv, >= max blocks], optional, for tests) gets
    1/0 for every full block the kernel visited. `num_splits` is rounded up to a power of two.
    `resident_programs`: the attend programs to spread the batch's kept blocks over (default: those
    the GPU runs at once minus one per (sequence, KV head), whose ceil() may each add one; 0, and
    the default with `num_splits`: only the per-sequence rule). `pdl`: the attend and the merge start
    while the previous launch ends (programmatic dependent launch; default: where the GPU has it,
    False: plain stream order). `sync`: the launches' int32 counters (`ffd_sync_buffer`), zero between calls and
    left zero by each, so one buffer serves every call on a stream (default: a zeroed one per call).
    Raises for shapes the kernel does not serve, for `pdl=True` where the GPU has no such launch, and
    for a `sync` buffer too small for the batch.
    """
    batch, num_heads, dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    check_ffd_inputs("FFD decode", q, k_cache, v_cache, block_tables, seq_lens, params)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    group = num_heads // kv_heads
    dev = q.device
    units = num_compute_units(dev)
    launchable = programmatic_launch(dev)
    if pdl and not launchable:
        raise ValueError(f"pdl=True: programmatic dependent launch needs an NVIDIA sm_90+ GPU; q is on {dev}")
    pdl = launchable if pdl is None else pdl
    dependent = {"launch_pdl": True} if pdl else {}     # launch options of the attend and the merge
    if sync is None:
        sync = ffd_sync_buffer(batch, kv_heads, dev)
    elif sync.dtype != torch.int32 or sync.device != dev or sync.numel() < sync_entries(batch, kv_heads):
        raise ValueError(f"sync must be int32 on {dev} with >= {sync_entries(batch, kv_heads)} entries "
                         f"(ffd_sync_buffer); got {sync.dtype} [{sync.numel()}] on {sync.device}")
    splits = triton.next_power_of_2(int(num_splits or choose_splits(batch, kv_heads, q.device, ATTEND_PROGRAMS_PER_SM)))
    min_per, dense_min_per = (1, 1) if num_splits else (MIN_PER_SPLIT, DENSE_MIN_PER_SPLIT)
    max_blocks = max(1, block_tables.shape[1])
    per_max = attend_slots(max_blocks, splits, min_per)
    flag_chunk = min(FLAG_CHUNK, triton.next_power_of_2(max_blocks))
    sink_parts = -(-params.sink_tokens // bs)
    num_parts = sink_parts + (-(-params.local_window // bs) + 1) + 1
    pm_slice = min(PM_SLICE, bs)
    pm_programs = num_parts * (bs // pm_slice)
    pm = torch.empty(batch * num_heads * pm_programs, dtype=torch.float32, device=dev)
    flags = torch.empty(batch * kv_heads * max_blocks, dtype=torch.int32, device=dev)   # page id or -1
    slots = torch.empty(batch * kv_heads * splits * per_max, dtype=torch.int32, device=dev)
    p_acc = torch.empty(batch * num_heads * splits * dim, dtype=torch.float32, device=dev)
    p_ml = torch.empty(batch * num_heads * splits * 2, dtype=torch.float32, device=dev)
    block_h = rows_per_tile(group)
    delta = params.delta_log2 if math.isfinite(params.delta_log2) else 1e30
    common = {"NUM_HEADS": num_heads, "NUM_KV_HEADS": kv_heads, "GROUP": group, "BLOCK_H": block_h, "D": dim,
              "D4": dim // 4, "BS": bs, "UPCAST": interpreting()}
    kmap = seq_lens if key_page_map is None else key_page_map      # any int32 tensor when unused
    q_strides = (q.stride(0), q.stride(1))
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    tokens_as_m = dim >= SCAN_TOKENS_AS_M_MIN_DIM
    scan_n = triton.next_power_of_2(group) if tokens_as_m else block_h
    bmax = torch.empty(batch * kv_heads * max_blocks * scan_n, dtype=torch.float32, device=dev)
    # the pseudo-max parts first: the lowest program ids, dispatched before the scan programs that wait on them
    scan_args = (q, k_cache, v_cache, kmap, codes, scales, residual, block_tables, seq_lens, pm, bmax, flags,
                 masks if masks is not None else flags, sync, *q_strides, *kv_strides, block_tables.stride(0),
                 masks.shape[2] if masks is not None else 0, max_blocks,
                 scale * LOG2E, delta, params.sink_tokens, params.local_window, params.min_ffd_len)
    scan_consts = dict(BPP=SCAN_BLOCKS_PER_STEP, SINK_PARTS=sink_parts, NUM_PARTS=num_parts,
                       PARTS_PAD=triton.next_power_of_2(pm_programs), HAS_KMAP=key_page_map is not None,
                       WRITE_MASK=masks is not None, SCAN_N=scan_n, TOKENS_AS_M=tokens_as_m, PM_SLICE=pm_slice,
                       DECIDE_CHUNK=DECIDE_CHUNK, PDL=pdl, num_warps=SCAN_WARPS, num_stages=SCAN_STAGES, **common)
    scan_splits = choose_splits(batch, kv_heads, dev, SCAN_PROGRAMS_PER_SM)
    sum_by_mma = scan_sum_by_mma(batch * kv_heads * scan_splits, units)
    if q.device.type == "cuda" and tokens_as_m and SCAN_SUM_BY_MMA is not False \
            and -(-max_blocks // scan_splits) >= SCAN_WAVE_MIN_STEPS:
        # under one wave of the MMA-sum form (B = 1): one full wave of it, so shorter programs
        consts = {**scan_consts, "SUM_BY_MMA": True}
        wave = resident_ctas(_scan_kernel, ("ffd_scan", q.dtype, tuple(consts.items())), scan_args, consts, dev) \
            * units // (batch * kv_heads) - pm_programs
        if wave > scan_splits:
            scan_splits, sum_by_mma = wave, True
    _scan_kernel[(batch, kv_heads, pm_programs + scan_splits)](*scan_args, SUM_BY_MMA=sum_by_mma, **scan_consts)
    attend_args = (q, k_cache, v_cache, kmap, codes, scales, residual, block_tables, seq_lens, flags, slots, p_acc,
                   p_ml, stats if stats is not None else p_ml, sync, *q_strides, *kv_strides,
                   block_tables.stride(0), max_blocks, scale * LOG2E, params.min_ffd_len)
    attend_consts = dict(NUM_SPLITS=splits, MIN_PER_SPLIT=min_per, DENSE_MIN_PER_SPLIT=dense_min_per,
                         PER_MAX=per_max, FLAG_CHUNK=flag_chunk, ONE_CHUNK=flag_chunk >= max_blocks,
                         COUNT=stats is not None, HAS_KMAP=key_page_map is not None, PDL=pdl, **common)
    attend_launch = {"num_warps": 4 if dim <= 128 else 8, "num_stages": attend_stages(bs, dim), **dependent}
    if resident_programs is None and not num_splits:
        resident_programs = attend_resident_per_sm(attend_args, {**attend_consts, **attend_launch}, q, k_cache) \
            * units - batch * kv_heads
    _attend_kernel[(batch, kv_heads, splits)](*attend_args, max(0, int(resident_programs or 0)),
                                              **attend_consts, **attend_launch)
    dc = min(dim, max(16, MERGE_TILE // splits))
    _merge_kernel[(batch, num_heads, dim // dc)](out, p_acc, p_ml, sync, out.stride(0), out.stride(1),
                                                 NUM_SPLITS=splits, NUM_HEADS=num_heads, D=dim, DC=dc, PDL=pdl,
                                                 num_warps=4, **dependent)
    return out
