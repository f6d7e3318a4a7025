"""FP8 KV pages: the code = saturate(x / scale) in an 8-bit float, one scale per KV head.

A cache whose dtype is one of `FP8_DTYPES` holds codes; the reader multiplies them back by the
head's scale (`k_scale` / `v_scale`, float32 [Hkv]). Saturating at the format's largest finite
value means an outlier past `scale * max` is clipped, never stored as inf or NaN. Every kernel and
reference that reads or writes pages takes the scales beside the caches, None for other dtypes.
"""
from __future__ import annotations

import math

import torch

# dtype -> mantissa bits (torch.finfo(float8_e5m2fnuz).eps says 3; the format has 2)
MANTISSA_BITS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2, torch.float8_e4m3fnuz: 3, torch.float8_e5m2fnuz: 2}
FP8_DTYPES = tuple(MANTISSA_BITS)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3fn, 240 for e4m3fnuz, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def fp8_grid(dtype: torch.dtype) -> dict[str, float | int]:
    """A kernel's constexprs for rounding onto `dtype`'s grid: LIMIT (largest finite value), EMIN
    (exponent of the smallest normal), MBITS (mantissa bits); zeros for a dtype that is not FP8."""
    if not is_fp8(dtype):
        return {"LIMIT": 0.0, "EMIN": 0, "MBITS": 0}
    info = torch.finfo(dtype)
    return {"LIMIT": float(info.max), "EMIN": round(math.log2(info.tiny)), "MBITS": MANTISSA_BITS[dtype]}


def check_scales(cache: torch.Tensor, scale: torch.Tensor | None, what: str) -> None:
    """An FP8 cache needs a float32 scale per KV head (cache [N, BS, Hkv, D]); other caches none."""
    if not is_fp8(cache.dtype):
        if scale is not None:
            raise ValueError(f"{what}: a scale applies to an FP8 cache only; the cache is {cache.dtype}")
        return
    if scale is None or scale.dtype != torch.float32 or scale.shape != (cache.shape[2],):
        got = "none" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
        raise ValueError(f"{what}: an {cache.dtype} cache needs a float32 scale per KV head "
                         f"[{cache.shape[2]}]; got {got}")


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., Hkv, D] -> codes of `dtype`: x / scale[h], saturated, rounded to nearest even."""
    limit = fp8_max(dtype)
    scaled = x.float() / scale.to(x.device)[:, None]
    return scaled.clamp_(-limit, limit).to(dtype)


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., Hkv, D] -> `dtype` values; a None scale means the pages are not FP8 (only cast)."""
    if scale is None:
        return codes.to(dtype)
    return (codes.float() * scale.to(codes.device)[:, None]).to(dtype)


def store_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None) -> None:
    """cache [N, BS, Hkv, D] at flat slots[T] <- rows [T, Hkv, D] (quantized when the cache is FP8)."""
    flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
    if is_fp8(cache.dtype):
        if scale is None:
            raise ValueError(f"an {cache.dtype} cache needs its per-head scale to be written")
        # index_copy_ has no float8 kernel on the CPU: copy the codes as bytes
        flat.view(torch.uint8).index_copy_(0, slots, quantize_kv(rows, scale, cache.dtype).view(torch.uint8))
    else:
        flat.index_copy_(0, slots, rows.to(cache.dtype))
