"""Host side shared by the paged decode kernels (flash, fdpp): shape checks, the split count, tile rows.

Splits are graph-safe: the host picks only `max_splits` (from the batch size and the SM count,
FA2's wave-efficiency rule); each program derives its sequence's chunk from `seq_lens` on the
device (`kernels.attention.splitkv.split_plan`) and programs past the last split exit.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import triton

from kernels.occupancy import resident_ctas
from kernels.vendor import DecodeConfig, num_compute_units

MAX_SPLITS = 128   # the merge holds all of a row's partials in registers


def choose_num_splits(batch: int, num_kv_heads: int, num_cus: int, ctas_per_sm: int,
                      max_splits: int = 64) -> int:
    """FA2's wave-efficiency rule: the fewest splits within 85 % of the best wave efficiency,
    for `num_cus * ctas_per_sm` resident CTAs.

    Depends only on the batch size and the GPU, so a CUDA graph captured per batch size keeps
    it; each sequence then uses only as many splits as its length needs (`split_plan`).
    """
    target = num_cus * ctas_per_sm
    work = batch * num_kv_heads
    if work >= 0.8 * target:
        return 1
    effs = [(work * s / target) / math.ceil(work * s / target) for s in range(1, max_splits + 1)]
    best = max(effs)
    return next(s for s, eff in enumerate(effs, 1) if eff >= 0.85 * best)


def check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int, int, int]:
    """(batch, num_heads, num_kv_heads, head_dim) after checking what the kernels assume."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.shape[3] != head_dim or head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16 matching the cache; got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("the head dimension of q and of the caches must be contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_tables and seq_lens must be int32")
    if block_tables.stride(1) != 1 or seq_lens.shape[0] != batch:
        raise ValueError("block_tables rows must be contiguous and seq_lens must be [B]")
    return batch, num_heads, num_kv_heads, head_dim


def check_plan_shapes(what: str, expected: tuple[int, ...], q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Raise unless q [B, Hq, D] and the cache pages [BS, Hkv, D] have the shapes a plan was made for:
    its workspaces and grid are sized by them."""
    got = (*q.shape, *k_cache.shape[1:])
    if got != expected:
        raise ValueError(f"{what}: q {tuple(q.shape)} / cache pages {tuple(k_cache.shape[1:])} do not match the "
                         f"plan's (B, Hq, D, BS, Hkv, D) = {expected}")


def rows_per_tile(group: int) -> int:
    return max(16, triton.next_power_of_2(group))


def resolve_splits(num_splits: int | None, batch: int, num_kv_heads: int, device: torch.device,
                   cfg: DecodeConfig, kernel: Any, key: tuple, args: Callable[[], tuple],
                   kwargs: dict[str, Any]) -> int:
    """Forced `num_splits`, or the wave heuristic for the kernel's resident CTAs per SM
    (`cfg.ctas_per_sm`, or 0: measured from the kernel compiled for `args()`; 2 in the interpreter)."""
    if num_splits:
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}; got {num_splits}")
        return int(num_splits)
    ctas = cfg.ctas_per_sm
    if not ctas:
        ctas = 2 if device.type != "cuda" else resident_ctas(kernel, key, args(), kwargs, device)
    return choose_num_splits(batch, num_kv_heads, num_compute_units(device), ctas, cfg.max_splits)


def probe_tensors(device: torch.device, *dtypes: torch.dtype) -> list[torch.Tensor]:
    """One-element stand-ins of these dtypes: a plan has shapes, not tensors, and compiling a kernel
    for its occupancy needs only the arguments' dtypes (and integer values, passed separately)."""
    return [torch.empty(1, dtype=dtype, device=device) for dtype in dtypes]


def contiguous_strides(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                       max_blocks: int) -> tuple[tuple[int, int], tuple[int, int, int], int]:
    """(q strides (b, h), cache strides (page, token, head), block-table row stride) of contiguous
    q [B, Hq, D], pages [N, BS, Hkv, D] and tables [B, max_blocks]: the integers a probe compile sees."""
    return (num_heads * head_dim, head_dim), (block_size * num_kv_heads * head_dim, num_kv_heads * head_dim,
                                             head_dim), max_blocks
