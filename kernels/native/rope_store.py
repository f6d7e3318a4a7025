"""RoPE on q and k and the K/V store into the pages, bf16 or float32, in one C++ call on the CPU (`rope_store.cpp`).

The torch form (`engine.model.layers.RotaryEmbedding` then the backend's index-copy store) is a dozen
small ops a layer, each a dispatch. Same roundings as that form.
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from kernels.native.build import load


@cache
def library() -> ctypes.CDLL:
    """The kernel built for this CPU (raises `NativeBuildError`)."""
    lib = load("rope_store")
    for entry in (lib.rope_store_bf16, lib.rope_store_f32):
        entry.restype = None
        entry.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int]
    return lib


ROW_DTYPES = (torch.bfloat16, torch.float32)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
          cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> bool:
    """Whether `rope_store_rows` takes these: CPU rows of one row stride (views into one projection) and
    contiguous pages, all bf16 or all float32; contiguous float32 cos/sin tables."""
    rows = (q, k, v)
    return (q.dtype in ROW_DTYPES
            and all(t.dtype == q.dtype and t.is_cpu and t.dim() == 2 and t.stride(1) == 1
                    and t.stride(0) == q.stride(0) for t in rows)
            and all(c.dtype == q.dtype and c.is_contiguous() for c in (k_cache, v_cache))
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in (cos_cache, sin_cache)))


def check_rows(positions: torch.Tensor, slot_mapping: torch.Tensor, max_position: int, num_slots: int) -> None:
    """Raise ValueError unless every position has a RoPE table row and every slot lies in the pages: the
    kernel reads and writes where they point. A step's layers share them, so a caller may check once."""
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= max_position
                              or int(slot_mapping.max()) >= num_slots):
        raise ValueError("rope_store_rows: a position past the RoPE tables or a slot past the pages")


def rope_store_rows(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    cos_cache: torch.Tensor, sin_cache: torch.Tensor, head_dim: int, rotary_dim: int,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                    rows_checked: bool = False) -> torch.Tensor:
    """q[T, Hq*D], k/v[T, Hkv*D] -> rotated q [T, Hq*D]; rotated k and v written into the pages
    [blocks, block_size, Hkv, D] at slot_mapping[T] (-1: skipped). Inputs must pass `takes`;
    `rows_checked`: the caller ran `check_rows` on these positions and slots."""
    if not takes(q, k, v, k_cache, v_cache, cos_cache, sin_cache):
        raise ValueError("rope_store_rows: CPU rows of one stride and pages, all bf16 or all float32, and float32 "
                         "tables expected")
    tokens = q.shape[0]
    num_kv_heads = k_cache.shape[2]
    if (k.shape[1] != num_kv_heads * head_dim or v.shape != k.shape or q.shape[1] % head_dim
            or k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape or cos_cache.shape[1] * 2 != rotary_dim):
        raise ValueError(f"rope_store_rows: q {tuple(q.shape)}, k/v {tuple(k.shape)} over pages "
                         f"{tuple(k_cache.shape)} with rotary_dim {rotary_dim}")
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    if not rows_checked:
        check_rows(positions, slots, cos_cache.shape[0], k_cache.shape[0] * k_cache.shape[1])
    out = torch.empty(tokens, q.shape[1], dtype=q.dtype)
    lib = library()
    entry = lib.rope_store_bf16 if q.dtype == torch.bfloat16 else lib.rope_store_f32
    entry(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), cos_cache.data_ptr(),
                              sin_cache.data_ptr(), positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(),
                              v_cache.data_ptr(), out.data_ptr(), tokens, q.shape[1] // head_dim, num_kv_heads,
                              head_dim, rotary_dim, torch.get_num_threads())
    return out
