"""Paged causal prefill on the CPU in C++: `reference.prefill_attention_ref`'s contract, one call per layer.

Two kernels, picked by the queries' dtype:
- `paged_prefill.cpp`, bf16 queries and pages on CPUs with AVX512-BF16 dot products: the probabilities are
  rounded to bf16 for P·V, as SDPA's bf16 CPU kernel does;
- `paged_prefill_f32.cpp`, float32 queries over float32 or bf16 pages on CPUs with AVX2 or AVX-512 FMAs:
  scores, softmax and P·V in float32.

Both pack every sequence's keys and values per KV head for their inner loops, then (sequence, KV head, query
rows) items walk the key blocks with an online softmax. A row's result does not depend on the chunk it is
computed in.
"""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from kernels.native.build import FLAGS, load
from kernels.native.pages import host_tables

HEAD_DIMS = (64, 128)
MAX_GROUP = 16


@cache
def library(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The kernel built for this CPU (raises `NativeBuildError`)."""
    lib = load("paged_prefill", flags)
    lib.paged_prefill_work_elements.restype = ctypes.c_int64
    lib.paged_prefill_work_elements.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.paged_prefill_attention.restype = ctypes.c_int
    lib.paged_prefill_attention.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib


@cache
def library_f32(flags: tuple[str, ...] = FLAGS) -> ctypes.CDLL:
    """The float32 kernel built for this CPU (raises `NativeBuildError`)."""
    lib = load("paged_prefill_f32", flags)
    lib.paged_prefill_f32_isa.restype = ctypes.c_char_p
    lib.paged_prefill_f32_work_floats.restype = ctypes.c_int64
    lib.paged_prefill_f32_work_floats.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.paged_prefill_f32_attention.restype = ctypes.c_int
    lib.paged_prefill_f32_attention.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def unsupported(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                kv_dtype: torch.dtype) -> str | None:
    """Why neither kernel can take these shapes on this CPU, or None when one can (builds it on first use)."""
    if dtype == torch.bfloat16 and kv_dtype == torch.bfloat16:
        if not library().paged_prefill_available():
            return "bf16 queries, and the CPU has no AVX512-BF16 dot products"
    elif dtype == torch.float32 and kv_dtype in (torch.float32, torch.bfloat16):
        if not library_f32().paged_prefill_f32_available():
            return f"float32 queries, and the build targets {library_f32().paged_prefill_f32_isa().decode()} " \
                   "(AVX2 or AVX-512 FMAs needed)"
    else:
        return f"{dtype} queries over {kv_dtype} pages (bf16 over bf16, or float32 over float32 or bf16)"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} KV heads (groups of at most {MAX_GROUP})"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (64 or 128)"
    return None


def kernel_name(dtype: torch.dtype) -> str:
    """The kernel that takes `dtype` queries, as a backend's name reports it."""
    if dtype == torch.bfloat16:
        return "C++ paged kernel (cpu, AVX512-BF16)"
    return f"C++ paged kernel (cpu, float32, {library_f32().paged_prefill_f32_isa().decode()})"


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
                            scale: float, num_threads: int | None = None,
                            out_dtype: torch.dtype | None = None, f32_library: ctypes.CDLL | None = None
                            ) -> torch.Tensor:
    """q[T, Hq, D] of each sequence's new tokens (the last q_len of its seq_lens[b] tokens, their K/V
    already in the pages) -> out[T, Hq, D] in `out_dtype` (default q's; the kernels' own is float32),
    causal. Host tensors; shapes must pass `unsupported`. `f32_library`: a build of the float32 kernel other
    than this CPU's default (the tests build the other vector width)."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    reason = unsupported(num_heads, num_kv_heads, head_dim, q.dtype, k_cache.dtype)
    if reason is not None:
        raise ValueError(f"paged_prefill_attention: {reason}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
            and v_cache.dtype == k_cache.dtype):
        raise ValueError("paged_prefill_attention: contiguous K and V caches of one shape and dtype expected")
    if {q.device.type, k_cache.device.type, v_cache.device.type} != {"cpu"}:
        raise ValueError("paged_prefill_attention: CPU tensors expected")
    tables, lens = host_tables(block_tables, seq_lens, block_size, num_blocks, "paged_prefill_attention")
    starts = query_start_loc.to(torch.int32).contiguous()
    q_lens = starts[1:] - starts[:-1]
    if (starts.shape[0] != lens.shape[0] + 1 or int(starts[0]) != 0 or int(starts[-1]) != num_tokens
            or bool((q_lens < 0).any()) or bool((q_lens > lens).any())):
        raise ValueError("paged_prefill_attention: query_start_loc must run from 0 to q's rows, each sequence's "
                         "new tokens at most its seq_lens")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    batch = lens.shape[0]
    out_dtype = out_dtype or q.dtype
    if num_tokens == 0:
        return out.to(out_dtype)
    qc = q.contiguous()
    threads = num_threads or torch.get_num_threads()
    if q.dtype == torch.float32:
        lib = f32_library or library_f32()
        work = torch.empty(lib.paged_prefill_f32_work_floats(lens.data_ptr(), batch, num_kv_heads, head_dim),
                           dtype=torch.float32)
        status = lib.paged_prefill_f32_attention(
            qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16),
            tables.data_ptr(), tables.stride(0), lens.data_ptr(), starts.data_ptr(), batch, num_heads, num_kv_heads,
            head_dim, block_size, scale, threads, work.data_ptr(), out.data_ptr())
    else:
        lib = library()
        work = torch.empty(lib.paged_prefill_work_elements(lens.data_ptr(), batch, num_kv_heads, head_dim),
                           dtype=torch.int16)
        status = lib.paged_prefill_attention(
            qc.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
            lens.data_ptr(), starts.data_ptr(), batch, num_heads, num_kv_heads, head_dim, block_size, scale, threads,
            work.data_ptr(), out.data_ptr())
    if status != 0:
        raise ValueError(f"paged_prefill_attention: the kernel refused {num_heads}/{num_kv_heads} heads of {head_dim}")
    return out if out_dtype == torch.float32 else out.to(out_dtype)
