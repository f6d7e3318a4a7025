"""Paged decode attention on the CPU in C++ (`paged_decode.cpp`): `reference.decode_attention_ref`'s contract.

One call per layer reads every sequence's pages through its block table: no gather, no Python per page.
The work is (sequence, token split) items on torch's OpenMP threads, each over every KV head of its page rows,
merged exactly by log-sum-exp; scores, softmax and P·V are float32 whatever the pages hold (float32 or bfloat16).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache

import torch

from kernels.native.build import FLAGS, load
from kernels.native.pages import host_tables

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


@dataclass(frozen=True)
class Limits:
    max_group: int
    max_dim: int
    dim_multiple: int
    max_kv_heads: int


@cache
def library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The kernel built for this CPU (or with other compiler `flags`, e.g. an older instruction set)."""
    lib = load("paged_decode", flags)
    lib.paged_decode_isa.restype = ctypes.c_char_p
    lib.paged_decode_num_splits.restype = ctypes.c_int
    lib.paged_decode_num_splits.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.paged_decode_work_floats.restype = ctypes.c_int64
    lib.paged_decode_work_floats.argtypes = [ctypes.c_int] * 5
    lib.paged_decode_attention.restype = None
    lib.paged_decode_attention.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
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
    return Limits(lib.paged_decode_max_group(), lib.paged_decode_max_dim(), lib.paged_decode_dim_multiple(),
                  lib.paged_decode_max_kv_heads())


def unsupported(num_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: torch.dtype) -> str | None:
    """Why the kernel cannot take these shapes, or None when it can."""
    if kv_dtype not in DTYPE_CODES:
        return f"pages of {kv_dtype} (float32 and bfloat16 only)"
    return _shape_unsupported(num_heads, num_kv_heads, head_dim)


def _shape_unsupported(num_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """Why the compiled kernel cannot take these head shapes, or None."""
    lim = limits()
    if num_heads % num_kv_heads or num_heads // num_kv_heads > lim.max_group:
        return f"{num_heads} query heads over {num_kv_heads} KV heads (groups of at most {lim.max_group})"
    if head_dim % lim.dim_multiple or head_dim > lim.max_dim:
        return f"head_dim {head_dim} (a multiple of {lim.dim_multiple}, at most {lim.max_dim})"
    if num_kv_heads > lim.max_kv_heads:
        return f"{num_kv_heads} KV heads (at most {lim.max_kv_heads})"
    return None


# Below this many (sequence, KV head, token) rows a call runs on one thread: starting the team costs more
# than the work (about 10 us against 5 us at 101 tokens of 3 heads, embedded default, 2-core CPU).
MIN_PARALLEL_ROWS = 2048


@dataclass(frozen=True)
class NativeDecodePlan:
    """A decode step's inputs for the kernel, made once per step: every layer reads the same pages."""

    block_tables: torch.Tensor   # int32, contiguous
    seq_lens: torch.Tensor       # int32, contiguous
    splits: int
    threads: int
    work: torch.Tensor           # float32 scratch: the items' softmax states and the scaled queries
    q_shape: tuple[int, int, int]                 # (batch, num_heads, head_dim)
    cache_shape: tuple[int, int, int, int]        # (num_blocks, block_size, num_kv_heads, head_dim)


def plan_native_decode(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_heads: int, num_kv_heads: int,
                       head_dim: int, block_size: int, num_blocks: int,
                       num_threads: int | None = None) -> NativeDecodePlan:
    """The step's `NativeDecodePlan` (host tensors; `num_threads` defaults to torch's). Every block id a
    sequence's length reaches must lie in [0, num_blocks): the kernel reads the pages they name."""
    reason = _shape_unsupported(num_heads, num_kv_heads, head_dim)
    if reason is not None:
        raise ValueError(f"paged_decode_attention: {reason}")
    tables, lens = host_tables(block_tables, seq_lens, block_size, num_blocks, "paged_decode_attention")
    batch = lens.shape[0]
    max_len = int(lens.max()) if batch else 0
    threads = num_threads or torch.get_num_threads()
    if batch * num_kv_heads * max_len < MIN_PARALLEL_ROWS:
        threads = 1
    lib = library()
    splits = lib.paged_decode_num_splits(batch, max_len, threads)   # the kernel's own rule (the C++ stack's too)
    work = torch.empty(lib.paged_decode_work_floats(batch, num_heads, num_kv_heads, head_dim, splits),
                       dtype=torch.float32)
    return NativeDecodePlan(tables, lens, splits, threads, work, (batch, num_heads, head_dim),
                            (num_blocks, block_size, num_kv_heads, head_dim))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                           plan: NativeDecodePlan | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """q[B, Hq, D] against caches [num_blocks, block_size, Hkv, D] -> [B, Hq, D] in q's dtype.

    `block_tables` [B, max_blocks] and `seq_lens` [B] are host tensors (int32 or int64); a sequence of
    length 0 gets zeros. `plan` (from `plan_native_decode` for these tables) is made here when not
    given. Pages of float32 or bfloat16; `lib`: a build from `library` (default: for this CPU)."""
    if plan is None:
        plan = plan_native_decode(block_tables, seq_lens, q.shape[1], k_cache.shape[2], q.shape[2],
                                  k_cache.shape[1], k_cache.shape[0])
    code = DTYPE_CODES.get(k_cache.dtype)
    if (code is None or v_cache.dtype != k_cache.dtype or tuple(k_cache.shape) != plan.cache_shape
            or tuple(v_cache.shape) != plan.cache_shape or not (k_cache.is_contiguous() and v_cache.is_contiguous())
            or not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu)):
        raise ValueError(f"paged_decode_attention: contiguous CPU K and V caches of {plan.cache_shape}, float32 or "
                         f"bfloat16, expected; got {k_cache.dtype} {tuple(k_cache.shape)} / {v_cache.dtype} "
                         f"{tuple(v_cache.shape)}")
    if tuple(q.shape) != plan.q_shape:
        raise ValueError(f"paged_decode_attention: a plan for q of {plan.q_shape}, q is {tuple(q.shape)}")
    native_q = q.dtype in DTYPE_CODES
    qc = (q if native_q else q.float()).contiguous()
    out = torch.empty_like(qc)
    if qc.shape[0]:
        (lib or library()).paged_decode_attention(
            qc.data_ptr(), DTYPE_CODES[qc.dtype], k_cache.data_ptr(), v_cache.data_ptr(), code,
            plan.block_tables.data_ptr(), plan.block_tables.stride(0), plan.seq_lens.data_ptr(),
            qc.shape[0], qc.shape[1], k_cache.shape[2], qc.shape[2], k_cache.shape[1], scale,
            plan.splits, plan.threads, plan.work.data_ptr(), out.data_ptr())
    return out if native_q else out.to(q.dtype)
