"""RMSNorm of bf16 rows on the CPU in one C++ call (`rms_norm.cpp`), optionally adding a residual first.

The torch form (`engine.model.layers.RMSNorm`) is eight or nine small ops a call, each a dispatch; a
decode step runs two per layer. Same roundings as that form; only the sum of squares is ordered
differently (results within a bf16 step of it).
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from kernels.native.build import load


@cache
def library() -> ctypes.CDLL:
    """The kernel built for this CPU (raises `NativeBuildError`)."""
    lib = load("rms_norm")
    lib.rms_norm_bf16.restype = None
    lib.rms_norm_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_int]
    return lib


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `rms_norm_bf16` takes these: bf16 CPU rows [T, H] with unit column stride, a bf16 [H] weight."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.device.type == "cpu"
            and x.dim() == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],) and weight.is_contiguous())


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight, or with `residual`: (norm(x + residual) * weight, x + residual). Inputs must pass `takes`."""
    if not takes(x, weight) or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype)):
        raise ValueError("rms_norm_bf16: bf16 CPU rows [T, H] (unit column stride), a bf16 [H] weight and an equal "
                         "residual expected")
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = None
    if residual is not None:
        residual = residual.contiguous()
        summed = torch.empty(x.shape, dtype=x.dtype)
    library().rms_norm_bf16(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                            out.data_ptr(), None if summed is None else summed.data_ptr(), weight.data_ptr(),
                            x.shape[0], x.shape[1], eps, torch.get_num_threads())
    return out if summed is None else (out, summed)
