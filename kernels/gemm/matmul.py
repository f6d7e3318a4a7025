"""Decode-phase linear layers, y[M, N] = x[M, K] · W[N, K]ᵀ (+ b), for small M.

cuBLAS tiles M to 64 or more, so at decode batch sizes most of each tile is padding, and tiling N
alone gives too few CTAs to fill the GPU on the narrow projections (FlashDecoding++ §4). Two
Triton kernels instead:
- flat GEMM (tensor cores): M padded only to 16 (the `tl.dot` minimum); narrow N tiles and, when
  those still leave SMs idle, K split across CTAs; the K loop is software-pipelined by Triton
  (`num_stages` ≥ 2 is FD++'s double buffering, 1 when `double_buffer` is off); fp32 accumulation.
- GEMV (CUDA cores, M ≤ GEMV_MAX_M): no `tl.dot`, so no padding; each CTA streams BLOCK_N rows of
  W with K-contiguous loads and reduces in fp32.
Split-K partials go to an fp32 workspace that a second small kernel sums in a fixed order (plus
bias), so results are deterministic (no atomics) and graph-safe (no counters to reset).
`matmul_ref` is the torch oracle.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.vendor import detect_vendor, interpreting, num_compute_units

GEMV_MAX_M = 8          # beyond this the broadcast-multiply of the GEMV outgrows its registers
REDUCE_BLOCK = 1024     # outputs per program of the split-K reduction


@dataclass(frozen=True)
class MatmulConfig:
    """Launch shape of one flat-GEMM or GEMV call (the GEMV ignores block_m: it holds all rows)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1          # CTAs sharing one output tile's K range
    num_stages: int = 3       # pipeline depth with double_buffer on; 1 when it is off
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"MatmulConfig.{name} must be a power of two, got {value}")
        if self.split_k < 1 or self.num_warps < 1:
            raise ValueError(f"MatmulConfig: split_k and num_warps must be >= 1 ({self})")
        if self.num_stages < 2:
            raise ValueError(f"MatmulConfig.num_stages is the double-buffered depth and must be >= 2, "
                             f"got {self.num_stages} (double_buffer = false is what runs 1 stage)")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MatmulConfig:
        unknown = set(data) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown MatmulConfig keys {sorted(unknown)}")
        return cls(**{k: int(v) for k, v in data.items()})


@dataclass(frozen=True)
class LaunchPlan:
    """What one call launches (exposed so tests and benchmarks can see split-K and stages)."""

    block_m: int
    grid: tuple[int, int, int]
    k_per_split: int          # K elements per split, a whole number of BLOCK_K tiles
    num_splits: int
    num_stages: int


# ----- kernels ---------------------------------------------------------------------------------

@triton.jit
def _store_or_stash(acc, offs_m, offs_n, M, N, B, Y, WS, pid_k, stride_ym,
                    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Epilogue: fp32 partial to the workspace (split-K), else bias, cast and store."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    rows = offs_m.to(tl.int64)[:, None]
    if SPLIT:
        tl.store(WS + (pid_k * M + rows) * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + rows * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _flat_gemm_kernel(X, W, B, Y, WS, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym,
                      k_per_split, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                      UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    # Padding rows/columns wrap onto real ones, so loads need no M/N masks (they stay vectorised);
    # their results are never stored.
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    x_ptrs = X + rm[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    w_ptrs = W + rn[None, :] * stride_wn + (k_start + offs_k)[:, None] * stride_wk   # Wᵀ tile [K, N]
    k_len = tl.minimum(K - k_start, k_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(tl.cdiv(k_len, BLOCK_K)):   # pipelined by Triton to `num_stages`
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_left = k_len - i * BLOCK_K
            x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if UPCAST:   # the interpreter mis-computes bf16 arithmetic
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(x, w, acc)   # float32 inputs would run as tf32 on NVIDIA; decode runs bf16/fp16
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    _store_or_stash(acc, offs_m, offs_n, M, N, B, Y, WS, pid_k, stride_ym, HAS_BIAS, SPLIT)


@triton.jit
def _gemv_kernel(X, W, B, Y, WS, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk, stride_ym,
                 k_per_split, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = pid_k * k_per_split
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)
    x_ptrs = X + rm[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    w_ptrs = W + rn[:, None] * stride_wn + (k_start + offs_k)[None, :] * stride_wk   # W rows, K contiguous
    k_len = tl.minimum(K - k_start, k_per_split)
    # Products accumulate elementwise and are reduced over K once, after the loop: a reduction
    # per tile would put cross-lane shuffles between every pair of loads.
    acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for i in range(tl.cdiv(k_len, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:
            k_left = k_len - i * BLOCK_K
            x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            w = tl.load(w_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        # CUDA-core FMAs in fp32 (also what the interpreter needs for bf16).
        acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    acc = tl.sum(acc3, axis=2)
    _store_or_stash(acc, offs_m, offs_n, M, N, B, Y, WS, pid_k, stride_ym, HAS_BIAS, SPLIT)


@triton.jit
def _splitk_reduce_kernel(WS, B, Y, M, N, stride_ym, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Y[m, :] = sum over splits in index order (deterministic) + bias."""
    m = tl.program_id(1).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs_n < N
    acc = tl.load(WS + m * N + offs_n, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(WS + (s * M + m) * N + offs_n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + offs_n, acc.to(Y.dtype.element_ty), mask=mask)


# ----- configs ---------------------------------------------------------------------------------

# Per vendor: (flat defaults, GEMV defaults). AMD has 64 KB of LDS per CU, so shallower pipelines
# and shorter K tiles (not measured on AMD). "cpu" is the interpreter: small tiles, no pipelining
# to model, so tests reach tails and several splits at small shapes.
_DEFAULTS: dict[str, tuple[MatmulConfig, MatmulConfig]] = {
    "nvidia": (MatmulConfig(block_k=128, num_stages=4), MatmulConfig(block_n=16, block_k=512, num_stages=3)),
    "amd": (MatmulConfig(block_k=64, num_stages=2), MatmulConfig(block_n=16, block_k=256, num_stages=2)),
    "cpu": (MatmulConfig(block_n=32, block_k=32, num_stages=2), MatmulConfig(block_n=16, block_k=32, num_stages=2)),
}


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def flat_block_m(m: int) -> int:
    """16 (the tl.dot minimum) up to M = 16; larger M tiles up to 64 so W is re-read less."""
    return min(max(16, _next_pow2(m)), 64)


def gemv_fits(config: MatmulConfig, m: int) -> bool:
    """The GEMV's [M, BLOCK_N, BLOCK_K] fp32 product stays within ~128 registers per thread."""
    return _next_pow2(m) * config.block_n * config.block_k <= 128 * 32 * config.num_warps


def default_config(impl: str, m: int, n: int, k: int, num_sms: int, vendor: str = "nvidia") -> MatmulConfig:
    """Untuned choice: the widest N tile that still gives one CTA per SM, then split-K (below)."""
    flat, gemv = _DEFAULTS[vendor]
    if impl == "gemv":   # shorter K tiles as rows grow, so the broadcast product fits in registers
        block_k = gemv.block_k
        while block_k > 16 and not gemv_fits(replace(gemv, block_k=block_k), m):
            block_k //= 2
        base = replace(gemv, block_k=block_k)
    else:
        base = replace(flat, block_m=flat_block_m(m))
    m_tiles = 1 if impl == "gemv" else triton.cdiv(m, base.block_m)
    block_n = base.block_n
    if impl == "flat":
        block_n = next((bn for bn in (128, 64) if triton.cdiv(n, bn) * m_tiles >= num_sms), 32)
    split = auto_split_k(triton.cdiv(n, block_n) * m_tiles, k, base.block_k, num_sms)
    return replace(base, block_n=block_n, split_k=split)


def auto_split_k(tiles: int, k: int, block_k: int, num_sms: int) -> int:
    """Double the K splits until tiles × splits ≥ 2 × SMs, each split keeping ≥ 2 K tiles."""
    split = 1
    while tiles * split < 2 * num_sms and k // (2 * split) >= 2 * block_k:
        split *= 2
    return split


def plan(impl: str, m: int, n: int, k: int, config: MatmulConfig, double_buffer: bool) -> LaunchPlan:
    """Grid (N tiles, K splits, M tiles); splits own whole BLOCK_K tiles and none is empty."""
    tiles = triton.cdiv(k, config.block_k)
    k_per_split = triton.cdiv(tiles, min(config.split_k, tiles)) * config.block_k
    num_splits = triton.cdiv(k, k_per_split)
    block_m = _next_pow2(m) if impl == "gemv" else config.block_m
    m_tiles = 1 if impl == "gemv" else triton.cdiv(m, block_m)
    return LaunchPlan(block_m, (triton.cdiv(n, config.block_n), num_splits, m_tiles), k_per_split,
                      num_splits, config.num_stages if double_buffer else 1)


# ----- entry points ----------------------------------------------------------------------------

def _matmul(impl: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            config: MatmulConfig | None, double_buffer: bool) -> torch.Tensor:
    n, k = weight.shape
    if x.shape[-1] != k or x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"{impl}: x {tuple(x.shape)} {x.dtype} {x.device} does not match weight "
                         f"{tuple(weight.shape)} {weight.dtype} {weight.device}")
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if impl == "gemv" and m > GEMV_MAX_M:
        raise ValueError(f"gemv handles M <= {GEMV_MAX_M} rows, got {m}; use flat_gemm")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    if config is None:
        vendor = detect_vendor() if x.is_cuda else "cpu"
        config = default_config(impl, m, n, k, num_compute_units(x.device), vendor)
    p = plan(impl, m, n, k, config, double_buffer)
    split = p.num_splits > 1
    ws = torch.empty((p.num_splits, m, n), dtype=torch.float32, device=x.device) if split else out
    b = bias if bias is not None else out   # never read when HAS_BIAS is false
    args = (x2, weight, b, out, ws, m, n, k, x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
            out.stride(0), p.k_per_split)
    common: dict[str, Any] = {"HAS_BIAS": bias is not None, "SPLIT": split, "EVEN_K": k % config.block_k == 0,
                              "BLOCK_M": p.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
                              "num_warps": config.num_warps, "num_stages": p.num_stages}
    if impl == "gemv":
        _gemv_kernel[p.grid](*args, **common)
    else:
        upcast = interpreting() and x.dtype != torch.float32
        _flat_gemm_kernel[p.grid](*args, UPCAST=upcast, **common)
    if split:
        _splitk_reduce_kernel[(triton.cdiv(n, REDUCE_BLOCK), m)](
            ws, b, out, m, n, out.stride(0), SPLIT_K=p.num_splits, HAS_BIAS=bias is not None,
            BLOCK=REDUCE_BLOCK, num_warps=4)
    return out.reshape(*x.shape[:-1], n)


def flat_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
              config: MatmulConfig | None = None, double_buffer: bool = True) -> torch.Tensor:
    """x[..., K] · weight[N, K]ᵀ (+ bias[N]) on tensor cores; output in x's dtype."""
    return _matmul("flat", x, weight, bias, config, double_buffer)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         config: MatmulConfig | None = None, double_buffer: bool = True) -> torch.Tensor:
    """As `flat_gemm` for at most GEMV_MAX_M rows, on CUDA cores (no padding of M)."""
    return _matmul("gemv", x, weight, bias, config, double_buffer)


def matmul_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               acc_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The exact product in `acc_dtype` (float64 for tests), not cast back."""
    out = x.to(acc_dtype) @ weight.to(acc_dtype).T
    return out + bias.to(acc_dtype) if bias is not None else out
