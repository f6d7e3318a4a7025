"""Float32 products of a few rows with block-quantized weights on the CPU, in C++ (`block_gemv.cpp`).

y = x · Wᵀ with float32 x [M <= 8, K] and W [N, K] = d · u + c, u an unsigned 4-bit or 8-bit code and d, c
half-precision numbers per (row, group of `group_size` inputs): a GGUF Q4_1 weight (d, min) or Q8_0 weight
(d, -128 d) as the file holds it, so the product equals the float32 one with the dequantized weight up to
summation order.
It reads an eighth (4-bit) or a quarter (8-bit) of the float32 weight's bytes, which is a decode step's
time on a CPU, and needs no bf16 hardware: vector extensions build it for AVX-512, AVX2 and NEON.

With `int16_inputs` (AVX2 builds, `block_gemv_i16.h`) each input row is first rounded to 16-bit integers per
group (the group's largest |x| to 32767) and the products run as integer multiply-adds: fewer instructions
a weight, and the result differs from float32's by that rounding of the inputs (a relative step of 2^-15).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from kernels.native.build import FLAGS, NativeBuildError, load

MAX_ROWS = 8       # x rows a call
BITS = (4, 8)


@dataclass(frozen=True)
class BlockWeight:
    """One [N, K] weight in the kernel's layout."""

    codes: torch.Tensor        # int32 words [N / W, K / P, W], P = 32 / bits codes a word
    scale_bias: torch.Tensor   # float16 [N / W, K / group_size, 2, W]: d, then c
    bits: int
    out_features: int
    in_features: int
    group_size: int


@cache
def library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The kernel built for this CPU (raises `NativeBuildError`)."""
    lib = load("block_gemv", flags)
    lib.block_gemv_isa.restype = ctypes.c_char_p
    for entry in (lib.block_gemv, lib.block_gemv_int16_inputs):
        entry.restype = ctypes.c_int
        entry.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return lib


def rows_per_tile() -> int:
    """Output rows the build handles together (its vector width in floats)."""
    return int(library().block_gemv_rows())


def isa() -> str:
    name = library().block_gemv_isa()
    return name.decode() if isinstance(name, bytes) else str(name)


def int16_inputs_available() -> bool:
    """Whether the kernel builds here with its 16-bit input form (AVX2 with F16C)."""
    try:
        return bool(library().block_gemv_int16_inputs_available())
    except NativeBuildError:   # no compiler, or the source did not build: nothing is available
        return False


# A group's 32-bit integer sums hold groups of up to this many inputs (8-bit codes times 16-bit inputs).
INT16_MAX_GROUP = 256


def unsupported(out_features: int, in_features: int, bits: int, group_size: int) -> str | None:
    """Why the kernel cannot take a weight of this shape, or None (builds it on first use)."""
    codes_per_word = 32 // bits if bits in BITS else 0
    if not codes_per_word:
        return f"{bits}-bit codes (4 or 8)"
    rows = rows_per_tile()
    if out_features % rows:
        return f"{out_features} output features (a multiple of {rows})"
    if group_size <= 0 or group_size % (2 * codes_per_word) or in_features % group_size:
        return f"{in_features} inputs in groups of {group_size} (whole groups of a multiple of {2 * codes_per_word})"
    return None


def pack(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int, group_size: int,
         rows: int | None = None) -> BlockWeight:
    """codes [N, K] in [0, 2^bits), scale d and bias c [N, K / group_size] (rounded to float16 here) -> the
    layout (W = d u + c), in tiles of `rows` (default: this build's `rows_per_tile()`)."""
    n, k = codes.shape
    reason = unsupported(n, k, bits, group_size)
    if rows is None:
        rows = rows_per_tile()
    elif n % rows:
        reason = f"{n} output features (a multiple of {rows})"
    if reason is not None:
        raise ValueError(f"block gemv: {reason}")
    if bool((codes < 0).any()) or bool((codes >= 1 << bits).any()):
        raise ValueError(f"block gemv: {bits}-bit codes must lie in [0, {(1 << bits) - 1}]")
    per_word = 32 // bits
    fields = codes.to(torch.int32).reshape(n, k // per_word, per_word)
    words = fields[..., 0].clone()
    for i in range(1, per_word):   # the top field reaches bit 31: the int32 wraps, the bits are the word's
        words |= fields[..., i] << (bits * i)
    packed = words.reshape(n // rows, rows, k // per_word).permute(0, 2, 1).contiguous()
    groups = k // group_size
    sb = torch.stack([scale.float().reshape(n // rows, rows, groups), bias.float().reshape(n // rows, rows, groups)],
                     dim=1)
    return BlockWeight(packed, sb.permute(0, 3, 1, 2).to(torch.float16).contiguous(), bits, n, k, group_size)


def dequantize(weight: BlockWeight) -> torch.Tensor:
    """The float64 [N, K] the packed weight multiplies by (the oracle's weight)."""
    n, k, g, bits = weight.out_features, weight.in_features, weight.group_size, weight.bits
    per_word = 32 // bits
    words = weight.codes.to(torch.int64) & 0xFFFFFFFF                         # [t, w, r]
    codes = (words[..., None] >> (torch.arange(per_word) * bits)) & ((1 << bits) - 1)   # [t, w, r, i]
    codes = codes.permute(0, 2, 1, 3).reshape(n, k).double()
    sb = weight.scale_bias.double()                                            # [t, g, 2, r]
    scale = sb[:, :, 0].permute(0, 2, 1).reshape(n, k // g).repeat_interleave(g, dim=1)
    bias = sb[:, :, 1].permute(0, 2, 1).reshape(n, k // g).repeat_interleave(g, dim=1)
    return codes * scale + bias


def block_gemv(x: torch.Tensor, weight: BlockWeight, *, num_threads: int | None = None,
               int16_inputs: bool = False) -> torch.Tensor:
    """x [M, K] float32, 1 <= M <= 8 (host, rows contiguous) -> x · Wᵀ [M, N] float32; `int16_inputs`: x
    rounded to 16 bits per group first (raises where the build lacks that kernel)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.shape[1] != weight.in_features or not x.is_cpu:
        raise ValueError(f"block gemv: float32 CPU x [M, {weight.in_features}] expected, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"block gemv: 1 to {MAX_ROWS} rows a call, got {x.shape[0]}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=torch.float32)
    if int16_inputs and not int16_inputs_available():
        raise ValueError("block gemv: this build has no 16-bit input kernel (it needs AVX2 and F16C)")
    entry = library().block_gemv_int16_inputs if int16_inputs else library().block_gemv
    status = entry(x.data_ptr(), x.stride(0), x.shape[0], weight.in_features, weight.bits, weight.codes.data_ptr(),
                   weight.scale_bias.data_ptr(), weight.out_features, weight.group_size, out.data_ptr(),
                   num_threads or torch.get_num_threads())
    if status != 0:
        raise ValueError(f"block gemv: the kernel refused {tuple(x.shape)} x {weight.bits}-bit "
                         f"[{weight.out_features}, {weight.in_features}] in groups of {weight.group_size}")
    return out
