"""Paged decode attention on the CPU in C++ (`paged_decode.cpp`): `reference.decode_attention_ref`'s contract.

One call per layer reads every sequence's pages through its block table: no gather, no Python per page.
The work is (sequence, KV head, token split) items on torch's OpenMP threads, merged exactly by
log-sum-exp; scores, softmax and P·V are float32 whatever the pages hold (float32 or bfloat16).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from kernels.native.build import FLAGS, load
from kernels.native.pages import host_tables

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Tokens a split covers at least, and the items per thread aimed at (dynamic scheduling evens them out).
MIN_SPLIT_TOKENS = 256
ITEMS_PER_THREAD = 4


@dataclass(frozen=True)
class Limits:
    max_group: int
    max_dim: int
    dim_multiple: int


@cache
def library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The kernel built for this CPU (or with other compiler `flags`, e.g. an older instruction set)."""
    lib = load("paged_decode", flags)
    lib.paged_decode_isa.restype = ctypes.c_char_p
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
        ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def isa(lib: ctypes.CDLL | None = None) -> str:
    """The vector instructions a build of the kernel targets ("AVX-512", "AVX2", "NEON", ...)."""
    name = (lib or library()).paged_decode_isa()
    return name.decode() if isinstance(name, bytes) else str(name)


@cache
def limits() -> Limits:
    """The shapes the compiled kernel takes (builds it on first use: raises `NativeBuildError`)."""
    lib = library()
    return Limits(lib.paged_decode_max_group(), lib.paged_decode_max_dim(), lib.paged_decode_dim_multiple())


def unsupported(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> str | None:
    """Why the kernel cannot take these shapes, or None when it can."""
    lim = limits()
    if kv_dtype not in DTYPE_CODES:
        return f"pages of {kv_dtype} (float32 and bfloat16 only)"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > lim.max_group:
        return f"{num_heads} query heads over {num_kv_heads} KV heads (groups of at most {lim.max_group})"
    if head_dim % lim.dim_multiple or head_dim > lim.max_dim:
        return f"head_dim {head_dim} (a multiple of {lim.dim_multiple}, at most {lim.max_dim})"
    return None


def num_splits(batch: int, num_kv_heads: int, max_len: int, num_threads: int) -> int:
    """Token splits per (sequence, KV head): enough items for every thread, none under `MIN_SPLIT_TOKENS`."""
    wanted = -(-num_threads * ITEMS_PER_THREAD // max(1, batch * num_kv_heads))
    return max(1, min(wanted, max_len // MIN_SPLIT_TOKENS))


@dataclass(frozen=True)
class NativeDecodePlan:
    """A decode step's inputs for the kernel, made once per step: every layer reads the same pages."""

    block_tables: torch.Tensor   # int32, contiguous
    seq_lens: torch.Tensor       # int32, contiguous
    splits: int
    threads: int
    work: torch.Tensor           # float32 scratch: the items' softmax states and the scaled queries
    shape: tuple[int, int, int, int, int]   # (num_heads, num_kv_heads, head_dim, block_size, num_blocks)


def plan_native_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int,
                       head_dim: int, block_size: int, num_blocks: int,
                       num_threads: int | None = None) -> NativeDecodePlan:
    """The step's `NativeDecodePlan` (host tensors; `num_threads` defaults to torch's). Every block id a
    sequence's length reaches must lie in [0, num_blocks): the kernel reads the pages they name."""
    tables, lens = host_tables(block_tables, seq_lens, block_size, num_blocks, "paged_decode_attention")
    batch = lens.shape[0]
    max_len = int(lens.max()) if batch else 0
    threads = num_threads or torch.get_num_threads()
    splits = num_splits(batch, num_kv_heads, max_len, threads)
    work = torch.empty(batch * num_kv_heads * splits * (num_heads // num_kv_heads) * (head_dim + 2)
                       + batch * num_heads * head_dim, dtype=torch.float32)
    return NativeDecodePlan(tables, lens, splits, threads, work,
                            (num_heads, num_kv_heads, head_dim, block_size, num_blocks))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                           plan: NativeDecodePlan | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """q[B, Hq, D] against caches [num_blocks, block_size, Hkv, D] -> [B, Hq, D] in q's dtype.

    `block_tables` [B, max_blocks] and `seq_lens` [B] are host tensors (int32 or int64); a sequence of
    length 0 gets zeros. `plan` (from `plan_native_decode` for these tables) is made here when not
    given. Shapes must pass `unsupported`. `lib`: a build from `library` (default: for this CPU)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.dtype == k_cache.dtype
            and v_cache.shape == k_cache.shape):
        raise ValueError("paged_decode_attention: contiguous K and V caches of one shape and dtype expected")
    if {q.device.type, k_cache.device.type, v_cache.device.type} != {"cpu"}:
        raise ValueError("paged_decode_attention: CPU tensors expected")
    reason = unsupported(num_heads, num_kv_heads, head_dim, k_cache.dtype)
    if reason is not None:
        raise ValueError(f"paged_decode_attention: {reason}")
    if plan is None:
        plan = plan_native_decode(block_tables, seq_lens, num_heads, num_kv_heads, head_dim, block_size,
                                  k_cache.shape[0])
    shape = (num_heads, num_kv_heads, head_dim, block_size, k_cache.shape[0])
    if plan.seq_lens.shape[0] != batch or plan.shape != shape:
        raise ValueError(f"paged_decode_attention: a plan for {plan.seq_lens.shape[0]} sequences of {plan.shape} "
                         f"(heads, KV heads, head_dim, block_size, blocks); q and the caches are {batch} of {shape}")
    out = torch.empty(batch, num_heads, head_dim, dtype=torch.float32)
    if batch == 0:
        return out.to(q.dtype)
    qf = q.to(torch.float32).contiguous()
    (lib or library()).paged_decode_attention(
        qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), DTYPE_CODES[k_cache.dtype],
        plan.block_tables.data_ptr(), plan.block_tables.stride(0), plan.seq_lens.data_ptr(),
        batch, num_heads, num_kv_heads, head_dim, block_size, scale,
        plan.splits, plan.threads, plan.work.data_ptr(), out.data_ptr())
    return out if q.dtype == torch.float32 else out.to(q.dtype)
