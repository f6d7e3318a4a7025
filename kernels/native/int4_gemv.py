"""Weight-only int4 products of a few rows on the CPU in C++ (`int4_gemv.cpp`), for CPUs with AVX512-BF16.

y = x · Wᵀ with bf16 x [M <= 8, K] and W [N, K] = (q - 8) · scale + zero, q a 4-bit code, scale and zero
bf16 per (row, group of `group_size` inputs): the same weights as `kernels.gemm.int4_cpu` in a layout
made for one vdpbf16ps per 16 rows and pair of inputs. A decode step's products are reads of every
weight, so this is a memory-bound kernel. An int8 weight fits it too, as two 4-bit planes
(`pack_int8_as_planes`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from kernels.native.build import FLAGS, load

ROWS = 16          # rows a tile
BLOCK = 32         # inputs a block
MAX_ROWS = 8       # x rows a call


@dataclass(frozen=True)
class NativeInt4Weight:
    """One [N, K] weight in the kernel's layout."""

    codes: torch.Tensor        # uint8 [N / 16, K / 32, 256]
    scale_zero: torch.Tensor   # bf16 [N / 16, K / group_size, 2, 16]
    out_features: int
    in_features: int
    group_size: int


@cache
def library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The kernel built for this CPU (raises `NativeBuildError`)."""
    lib = load("int4_gemv", flags)
    lib.int4_gemv.restype = ctypes.c_int
    lib.int4_gemv.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    return lib


def unsupported(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why the kernel cannot take a weight of this shape on this CPU, or None (builds it on first use)."""
    if not library().int4_gemv_available():
        return "the CPU has no AVX512-BF16 dot products"
    if out_features % ROWS:
        return f"{out_features} output features (a multiple of {ROWS})"
    if group_size % BLOCK or in_features % group_size:
        return f"{in_features} inputs in groups of {group_size} (whole groups, a multiple of {BLOCK})"
    return None


def pack(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> NativeInt4Weight:
    """codes [N, K] in [0, 15], scale and zero [N, K / group_size] (rounded to bf16 here) -> the layout."""
    n, k = codes.shape
    reason = unsupported(n, k, group_size)
    if reason is not None:
        raise ValueError(f"int4 gemv: {reason}")
    if bool((codes < 0).any()) or bool((codes > 15).any()):
        raise ValueError("int4 gemv: codes must lie in [0, 15]")
    # [tile, row, block, pair j + 4 i, element] -> word (row, element) of load j holds nibble i.
    q = codes.to(torch.int32).reshape(n // ROWS, ROWS, k // BLOCK, 4, 4, 2)   # [t, r, b, i, j, e]
    q = q.permute(0, 2, 4, 1, 5, 3)                                             # [t, b, j, r, e, i]
    little_endian = torch.stack([q[..., 0] | (q[..., 1] << 4), q[..., 2] | (q[..., 3] << 4)], dim=-1)
    packed = little_endian.to(torch.uint8).contiguous().reshape(n // ROWS, k // BLOCK, 256)
    groups = k // group_size
    sz = torch.stack([scale.reshape(n // ROWS, ROWS, groups), zero.reshape(n // ROWS, ROWS, groups)], dim=1)
    sz = sz.permute(0, 3, 1, 2).to(torch.bfloat16).contiguous()                 # [t, g, 2, r]
    return NativeInt4Weight(packed, sz, n, k, group_size)


def pack_int8_as_planes(codes: torch.Tensor, scales: torch.Tensor) -> NativeInt4Weight:
    """An int8 weight (codes [N, K] in [-127, 127], one scale per row) as a [N, 2K] int4 weight over the input
    twice, [x, x]: c + 128 = 16 h + l, so s c = (h - 8) 16 s + (l - 8) s + 8 s. Exact in bf16 for bf16 s."""
    n, k = codes.shape
    shifted = codes.to(torch.int32) + 128
    planes = torch.cat([shifted >> 4, shifted & 15], dim=1)
    s = scales.to(torch.bfloat16).float()[:, None]
    return pack(planes, torch.cat([16 * s, s], dim=1), torch.cat([torch.zeros_like(s), 8 * s], dim=1), k)


def dequantize(weight: NativeInt4Weight) -> torch.Tensor:
    """The float32 [N, K] the packed weight multiplies by (the oracle's weight)."""
    n, k, g = weight.out_features, weight.in_features, weight.group_size
    byte = weight.codes.to(torch.int32).reshape(n // ROWS, k // BLOCK, 4, ROWS, 2, 2)   # [t, b, j, r, e, byte]
    nibbles = torch.stack([byte[..., 0] & 15, byte[..., 0] >> 4, byte[..., 1] & 15, byte[..., 1] >> 4], dim=-1)
    codes = nibbles.permute(0, 3, 1, 5, 2, 4).reshape(n, k).float()
    sz = weight.scale_zero.float()                                              # [t, g, 2, r]
    scale = sz[:, :, 0].permute(0, 2, 1).reshape(n, k // g).repeat_interleave(g, dim=1)
    zero = sz[:, :, 1].permute(0, 2, 1).reshape(n, k // g).repeat_interleave(g, dim=1)
    return (codes - 8) * scale + zero


def int4_gemv(x: torch.Tensor, weight: NativeInt4Weight, *, out_dtype: torch.dtype = torch.bfloat16,
              num_threads: int | None = None) -> torch.Tensor:
    """x [M, K] bf16, 1 <= M <= 8 (host, rows contiguous) -> x · Wᵀ [M, N] in `out_dtype` (bf16 or float32)."""
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.shape[1] != weight.in_features or not x.is_cpu:
        raise ValueError(f"int4 gemv: bf16 CPU x [M, {weight.in_features}] expected, got {x.dtype} {tuple(x.shape)}")
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"int4 gemv: 1 to {MAX_ROWS} rows a call, got {x.shape[0]}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"int4 gemv: bf16 or float32 output, not {out_dtype}")
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], weight.out_features, dtype=out_dtype)
    status = library().int4_gemv(x.data_ptr(), x.stride(0), x.shape[0], weight.in_features, weight.codes.data_ptr(),
                                 weight.scale_zero.data_ptr(), weight.out_features, weight.group_size,
                                 out.data_ptr(), int(out_dtype == torch.bfloat16),
                                 num_threads or torch.get_num_threads())
    if status != 0:
        raise ValueError(f"int4 gemv: the kernel refused {tuple(x.shape)} x [{weight.out_features}, "
                         f"{weight.in_features}] in groups of {weight.group_size}")
    return out
