"""FFD quantize-on-write in Triton: when a token completes its KV page, that page's keys become 2-bit
codes, per-channel scales and an FP8-E4M3 residual in units of the scale (the format of
`kernels/ffd/reference.py`, whose `quantize_on_write_ref` is the torch reference). One program per
(token, KV head); the skip is decided on the device, so the launch is graph-safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.kv_store import key_page
from kernels.ffd.reference import RESIDUAL_SCALE
from kernels.vendor import interpreting


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
def _quantize_kernel(K, SLOTS, KMAP, CODES, SCALES, RES, stride_kb, stride_kt, stride_kh,
                     NUM_KV_HEADS: tl.constexpr, BS: tl.constexpr, D: tl.constexpr, D4: tl.constexpr,
                     RES_SCALE: tl.constexpr, UPCAST: tl.constexpr, HAS_KMAP: tl.constexpr):
    t = tl.program_id(0)
    hk = tl.program_id(1)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if (slot >= 0) & (slot % BS == BS - 1):              # this token completed its page
        page = slot // BS
        rows = tl.arange(0, BS)
        cols = tl.arange(0, D4)
        src = K + key_page(KMAP, page, HAS_KMAP) * stride_kb + hk * stride_kh + rows[:, None].to(tl.int64) * stride_kt
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
                      residual: torch.Tensor, slot_mapping: torch.Tensor,
                      key_page_map: torch.Tensor | None = None) -> None:
    """Quantize each page whose last row a token of this step wrote (after the K/V store); its
    exact keys are k_cache page `key_page_map[page]` when given (`kernels.attention.kv_store`), else `page`.

    One program per (token, KV head); the page-full test runs on the device: graph-safe.
    """
    num_tokens = slot_mapping.shape[0]
    _, bs, kv_heads, dim = k_cache.shape
    if num_tokens == 0:
        return
    if k_cache.stride(3) != 1 or not (codes.is_contiguous() and scales.is_contiguous() and residual.is_contiguous()):
        raise ValueError("quantize_on_write needs a contiguous head dim and contiguous quantized tensors")
    _quantize_kernel[(num_tokens, kv_heads)](
        k_cache, slot_mapping, slot_mapping if key_page_map is None else key_page_map, codes, scales, residual,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=kv_heads, BS=bs, D=dim, D4=dim // 4, RES_SCALE=RESIDUAL_SCALE, UPCAST=interpreting(),
        HAS_KMAP=key_page_map is not None, num_warps=4)
