"""The FFD kernels' bit-level operand builders: PTX that turns packed 2-bit codes and e4m3 residual
bytes into MMA operands with a few integer instructions (the conversion unit, 16 results per clock
and SM, is the scarce resource of the decode), and the constants of those formats. Pure Python:
strings and numbers that `kernels/ffd/tiles.py` and `kernels/ffd/scan.py` pass to
`tl.inline_asm_elementwise`, tested bit for bit in `tests/kernels/test_ffd_kernels.py`.
"""
from __future__ import annotations

import math

import triton.language as tl

from kernels.ffd.reference import RESIDUAL_SCALE

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
