"""RMSNorm of bf16 or float32 rows on the CPU in one C++ call (`rms_norm.cpp`), optionally adding a residual first.

`rms_norm_torch` is the torch form (eight or nine small ops, each a dispatch; a decode step runs two
per layer). The C++ call gives its bits exactly: same roundings, and the sum of squares added in the
order torch's CPU sum uses. That order depends on torch's vector width, so `torch_order_lanes` checks
the kernel against `rms_norm_torch` on random rows at first use and says which width matches, or None
(then the torch form runs).
"""
from __future__ import annotations

import ctypes
import itertools
import logging
from functools import cache

import torch

from kernels.native.build import FLAGS, NativeBuildError, load

logger = logging.getLogger(__name__)

LANE_WIDTHS = (8, 16)
MAX_HIDDEN = 16384
# A fused multiply-add would round the squares' sum differently from torch.
NORM_FLAGS = (*FLAGS, "-ffp-contract=off")


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight, or with `residual`: (norm(x + residual) * weight, x + residual); the norm in
    float32, cast back before the weight as transformers does (so low-precision outputs match it)."""
    summed = x if residual is None else x + residual
    xf = summed.float()
    out = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(summed.dtype)
    return out if residual is None else (out, summed)


@cache
def library(flags: tuple[str, ...] = NORM_FLAGS) -> ctypes.CDLL:
    """The kernel built for this CPU (raises `NativeBuildError`)."""
    lib = load("rms_norm", flags)
    for entry in (lib.rms_norm_bf16, lib.rms_norm_f32):
        entry.restype = ctypes.c_int
        entry.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int, ctypes.c_int]
    lib.rms_mean_of_squares.restype = ctypes.c_int
    lib.rms_mean_of_squares.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_void_p]
    return lib


ROW_DTYPES = (torch.bfloat16, torch.float32)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm_rows` takes these: bf16 or float32 CPU rows [T, H] with unit column stride, an [H]
    weight of the same dtype."""
    return (x.dtype in ROW_DTYPES and weight.dtype == x.dtype and x.device.type == "cpu"
            and x.dim() == 2 and x.stride(1) == 1 and 0 < x.shape[1] <= MAX_HIDDEN
            and weight.shape == (x.shape[1],) and weight.is_contiguous())


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None, *,
                  lanes: int, lib: ctypes.CDLL | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_torch` in one call, its sum of squares in `lanes`-wide order. Inputs must pass `takes`."""
    if not takes(x, weight) or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype)):
        raise ValueError(f"rms_norm_rows: bf16 or float32 CPU rows [T, H <= {MAX_HIDDEN}] (unit column stride), "
                         "a weight [H] and a residual equal in dtype and shape expected")
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = None
    if residual is not None:
        residual = residual.contiguous()
        summed = torch.empty(x.shape, dtype=x.dtype)
    lib = lib or library()
    entry = lib.rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm_f32
    status = entry(
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(), out.data_ptr(),
        None if summed is None else summed.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps, lanes,
        torch.get_num_threads())
    if status != 0:
        raise ValueError(f"rms_norm_rows: lanes {lanes} (8 or 16)")
    return out if summed is None else (out, summed)


def mean_of_squares(x: torch.Tensor, *, lanes: int, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The kernel's float32 mean of each bf16 row's squares [T] (torch's: `x.float().pow(2).mean(-1)`)."""
    out = torch.empty(x.shape[0], dtype=torch.float32)
    if x.dtype != torch.bfloat16 or not takes(x, torch.empty(x.shape[1], dtype=torch.bfloat16)):
        raise ValueError("mean_of_squares: bf16 CPU rows [T, H] with unit column stride expected")
    status = (lib or library()).rms_mean_of_squares(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], lanes,
                                                    out.data_ptr())
    if status != 0:
        raise ValueError(f"mean_of_squares: lanes {lanes} (8 or 16)")
    return out


def bit_identical(lanes: int, lib: ctypes.CDLL | None = None, seed: int = 0) -> bool:
    """Whether the kernel with `lanes` gives `rms_norm_torch`'s bits on random rows of several widths: the
    float32 mean of squares (where an order difference shows) and the outputs, bf16 and float32."""
    gen = torch.Generator().manual_seed(seed)
    for (rows, hidden), dtype in itertools.product(
            ((1, 576), (3, 576), (70, 576), (2, 64), (5, 100), (1, 2048), (2, 4113)), ROW_DTYPES):
        x = (torch.randn(rows, hidden, generator=gen) * 4).to(dtype)
        residual = torch.randn(rows, hidden, generator=gen).to(dtype)
        weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
        if dtype == torch.bfloat16 and not torch.equal(mean_of_squares(x, lanes=lanes, lib=lib),
                                                       x.float().pow(2).mean(-1)):
            return False
        for res in (None, residual):
            got = rms_norm_rows(x, weight, 1e-5, res, lanes=lanes, lib=lib)
            want = rms_norm_torch(x, weight, 1e-5, res)
            got_parts = got if isinstance(got, tuple) else (got,)
            want_parts = want if isinstance(want, tuple) else (want,)
            if not all(torch.equal(a, b) for a, b in zip(got_parts, want_parts, strict=True)):
                return False
    return True


@cache
def torch_order_lanes() -> int | None:
    """The lane width whose order gives torch's bits on this machine, or None (no build, or neither matches)."""
    try:
        library()
    except NativeBuildError as err:
        logger.info("RMSNorm on the CPU: torch's ops (the C++ kernel did not build: %s)", str(err).splitlines()[0])
        return None
    for lanes in LANE_WIDTHS:
        if bit_identical(lanes):
            logger.info("RMSNorm on the CPU: one C++ call, bit for bit torch's (%d-lane order)", lanes)
            return lanes
    logger.info("RMSNorm on the CPU: torch's ops (the C++ kernel's sums do not match this torch's order)")
    return None
