"""Write a step's new K/V into the paged cache by `slot_mapping` (Triton; -1 slots are padding).

K pages may live in a pool of their own, smaller than the V pages (FFD keeps exact keys only for
pages being filled): `key_page_map[page]` is then the K pool page holding `page`'s keys. FP8 pages
store saturated codes x / scale (`kernels.attention.kv_quant`), rounded to nearest even."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention.kv_quant import check_scales, fp8_grid, is_fp8
from kernels.vendor import configs_for


@triton.jit
def key_page(KMAP, page, HAS_KMAP: tl.constexpr):
    """The K page holding `page`'s keys: `page` itself, or KMAP[page] for a separate K pool.

    A page without exact keys (-1) reads as pool page 0: only padding rows (CUDA-graph buckets,
    page 0, length 1) ask for one; the engine maps every page a real row reads."""
    if HAS_KMAP:
        return tl.maximum(tl.load(KMAP + page), 0).to(tl.int64)
    return page.to(tl.int64)


@triton.jit
def quantize_rows(x, SCALE, h, h_ok, LIMIT: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr,
                  DTYPE: tl.constexpr):
    """Rows [BLOCK_H, D] of heads `h` as FP8 codes of x / SCALE[h], saturated at +-LIMIT.

    Rounded to nearest even on the format's grid in float32 arithmetic (the grid step is
    2^(max(exponent, EMIN) - MBITS), EMIN the smallest normal exponent), so the final cast is
    exact on every backend and the codes equal torch's conversion."""
    scale = tl.load(SCALE + h, mask=h_ok, other=1.0)
    scaled = tl.minimum(tl.maximum(x.to(tl.float32) / scale[:, None], -LIMIT), LIMIT)
    exponent = tl.maximum(((scaled.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
    step = ((exponent - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    steps = scaled / step                              # |steps| < 2^(MBITS + 1): exact
    steps = (steps + 12582912.0) - 12582912.0          # + 1.5 * 2^23: float32 rounds to an integer, ties to even
    return (steps * step).to(DTYPE)


@triton.jit
def _store_kv_kernel(KEY, VALUE, K_CACHE, V_CACHE, SLOTS, KMAP, K_SCALE, V_SCALE,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                     NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, PAGE: tl.constexpr, HAS_KMAP: tl.constexpr,
                     QUANT: tl.constexpr, LIMIT: tl.constexpr, EMIN: tl.constexpr, MBITS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (h < NUM_KV_HEADS)[:, None] & (d < D)[None, :]
        row = (slot % PAGE) * stride_ct + h[:, None] * stride_ch + d[None, :]
        k = tl.load(KEY + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(VALUE + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        if QUANT:
            k = quantize_rows(k, K_SCALE, h, h < NUM_KV_HEADS, LIMIT, EMIN, MBITS, K_CACHE.dtype.element_ty)
            v = quantize_rows(v, V_SCALE, h, h < NUM_KV_HEADS, LIMIT, EMIN, MBITS, V_CACHE.dtype.element_ty)
        tl.store(K_CACHE + key_page(KMAP, slot // PAGE, HAS_KMAP) * stride_cb + row, k.to(K_CACHE.dtype.element_ty),
                 mask=mask)
        tl.store(V_CACHE + (slot // PAGE) * stride_cb + row, v.to(V_CACHE.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, key_page_map: torch.Tensor | None = None,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """key/value[T, Hkv, D] -> caches[num_blocks, block_size, Hkv, D] at slot_mapping[T]; with
    `key_page_map` (int32 [num_blocks]) the keys go to k_cache page key_page_map[slot // block_size].
    FP8 caches (both of one dtype) take their per-head float32 `k_scale` / `v_scale` [Hkv].

    One program per token, grid fixed by T and the skip decided on the device: graph-safe.
    """
    check_scales(k_cache, k_scale, "store_kv")
    check_scales(v_cache, v_scale, "store_kv")
    quant = is_fp8(v_cache.dtype)
    if quant and k_cache.dtype != v_cache.dtype:
        raise ValueError(f"store_kv: FP8 caches must share a dtype; got {k_cache.dtype} / {v_cache.dtype}")
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if k_cache.stride() != v_cache.stride() or key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("caches must share strides; key/value need a contiguous head dimension")
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, slot_mapping if key_page_map is None else key_page_map,
        slot_mapping if k_scale is None else k_scale, slot_mapping if v_scale is None else v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, BLOCK_H=triton.next_power_of_2(num_kv_heads), D=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), PAGE=k_cache.shape[1], HAS_KMAP=key_page_map is not None,
        QUANT=quant, **fp8_grid(v_cache.dtype),
        num_warps=configs_for(key.device).store_warps)
