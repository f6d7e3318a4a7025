"""FlashDecoding++ asynchronous softmax over paged KV: one unified max φ, no merge pass, as plan + run.

Every split exponentiates its scores against the same φ (log2 units inside the kernel), so its
partial (Σ 2^(s-φ)·v, Σ 2^(s-φ)) needs no rescale and partials add as plain sums. The splits
`atomic_add` their partials into a zeroed fp32 workspace; the last split of a (sequence, KV head)
to finish (an acq_rel counter) divides, writes the output and re-zeroes the workspace for the
next launch. One launch, no separate merge kernel; the sum order is not fixed, so the last bits
are not deterministic.

φ comes from the caller (a calibrated per-layer value or a forced number) or, with `phi=None`,
is estimated per row and step as the max score over the sink and local-window tokens: every
split computes the same estimate from the same tokens, so they agree without talking.

Range check: the true row max M (an atomic max, no exponentials) must satisfy
LO <= M - φ <= HI (`kernels.attention.reference.safe_window`) and the sum must be finite and positive.
Flagged rows are counted in `stats[0]` either way; with `fallback` the last split recomputes its
KV head's rows exactly (one program walks the whole sequence: slow, and meant to be rare).

Decode is bandwidth-bound, so the rescale this removes is not on the critical path; how it compares
with flash on the H200 is in bench/RESULTS.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.attention.decode_host import (
    check_plan_shapes,
    check_shapes,
    contiguous_strides,
    probe_tensors,
    resolve_splits,
    rows_per_tile,
)
from kernels.attention.kv_quant import check_scales, is_fp8
from kernels.attention.reference import safe_window
from kernels.attention.splitkv import LOG2E, attend, fp8_queries, head_scales, load_q_rows, split_plan, store_rows
from kernels.vendor import DecodeConfig, check_launch_options, configs_for, interpreting


@triton.jit
def _estimate_phi(q, K, bt_row, L, hk, stride_kb, stride_kt, stride_kh, scale_log2,
                  PAGE: tl.constexpr, D: tl.constexpr, EST_SINK: tl.constexpr,
                  EST_N: tl.constexpr, UPCAST: tl.constexpr):
    """Row max over the first EST_SINK and the last EST_N - EST_SINK tokens (log2 units)."""
    i = tl.arange(0, EST_N)
    pos = tl.where(i < EST_SINK, i, L - EST_N + i)
    ok = (pos >= 0) & (pos < L)
    pos = tl.where(ok, pos, 0)
    page = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
    tok = page * stride_kb + (pos % PAGE).to(tl.int64) * stride_kt + hk * stride_kh
    k = tl.load(K + tok[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
    s = tl.where(ok[None, :], tl.dot(q, tl.trans(k.to(q.dtype))) * scale_log2, float("-inf"))
    phi = tl.max(s, 1)
    return tl.where(phi > float("-inf"), phi, 0.0)     # L == 0: nothing to estimate


@triton.jit
def _finalize(OUT, STATS, q, K, V, bt_row, b, hk, L, acc, denom, m, phi, lo_win, hi_win,
              stride_kb, stride_kt, stride_kh, stride_ob, stride_oh, scale_log2, v_scale,
              GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
              BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr,
              UPCAST: tl.constexpr, FALLBACK: tl.constexpr, PAGE_WINDOW: tl.constexpr):
    """Range-check the summed rows, count the bad ones, recompute them exactly if asked, store."""
    rows = tl.arange(0, BLOCK_H)
    excess = m - phi
    bad = (excess > hi_win) | (excess < lo_win) | (denom != denom) | (denom == float("inf")) | (denom <= 0)
    bad = bad & (rows < GROUP) & (L > 0)
    num_bad = tl.sum(bad.to(tl.int32), 0)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    if num_bad > 0:
        tl.atomic_add(STATS, num_bad.to(tl.int64))
        if FALLBACK:
            _, l_x, acc_x = attend(q, K, V, bt_row, 0, L, hk, stride_kb, stride_kt, stride_kh, scale_log2,
                                   phi, False, BLOCK_H, PAGE, BLOCK_N, D, NUM_STAGES, PREFETCH, UPCAST,
                                   PAGE_WINDOW)
            out = tl.where(bad[:, None], acc_x / tl.where(l_x > 0, l_x, 1.0)[:, None], out)
    store_rows(OUT, out * v_scale, b, hk, stride_ob, stride_oh, GROUP, BLOCK_H, D)


@triton.jit
def _fdpp_kernel(Q, K, V, BT, SEQ, OUT, WS_ACC, WS_L, WS_M, WS_COUNT, STATS, K_SCALE, V_SCALE,
                 stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                 stride_ob, stride_oh, scale_log2, phi_log2, lo_win, hi_win, max_splits, min_chunk,
                 NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_H: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, UPCAST: tl.constexpr,
                 PAGE_WINDOW: tl.constexpr, ESTIMATE: tl.constexpr,
                 EST_SINK: tl.constexpr, EST_N: tl.constexpr, FALLBACK: tl.constexpr,
                 HAS_SCALE: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(SEQ + b)
    chunk, num_splits = split_plan(L, max_splits, min_chunk, BLOCK_N)
    if split < num_splits:
        lo = split * chunk
        hi = tl.minimum(lo + chunk, L)
        q = load_q_rows(Q, b, hk, stride_qb, stride_qh, GROUP, BLOCK_H, D, UPCAST)
        bt_row = BT + b.to(tl.int64) * stride_bt
        k_scale, v_scale = head_scales(K_SCALE, V_SCALE, hk, HAS_SCALE)
        scale_log2 = scale_log2 * k_scale
        if HAS_SCALE:
            q = fp8_queries(q, scale_log2, Q.dtype.element_ty, UPCAST)
            scale_log2 = 1.0
        if ESTIMATE:
            phi = _estimate_phi(q, K, bt_row, L, hk, stride_kb, stride_kt, stride_kh, scale_log2,
                                PAGE, D, EST_SINK, EST_N, UPCAST)
        else:
            phi = tl.full([BLOCK_H], phi_log2, tl.float32)
        m, denom, acc = attend(q, K, V, bt_row, lo, hi, hk, stride_kb, stride_kt, stride_kh, scale_log2,
                           phi, True, BLOCK_H, PAGE, BLOCK_N, D, NUM_STAGES, PREFETCH, UPCAST, PAGE_WINDOW)
        if num_splits > 1:
            rows = tl.arange(0, BLOCK_H)
            row_ok = rows < GROUP
            ws = b.to(tl.int64) * NUM_HEADS + hk * GROUP + rows
            acc_ptr = WS_ACC + ws[:, None] * D + tl.arange(0, D)[None, :]
            tl.atomic_add(acc_ptr, acc, mask=row_ok[:, None], sem="relaxed")
            tl.atomic_add(WS_L + ws, denom, mask=row_ok, sem="relaxed")
            tl.atomic_max(WS_M + ws, m, mask=row_ok, sem="relaxed")
            tl.debug_barrier()   # every thread's adds are issued before the counter's release
            count = WS_COUNT + b.to(tl.int64) * NUM_KV_HEADS + hk
            if tl.atomic_add(count, 1, sem="acq_rel") == num_splits - 1:
                # Last split: read the sums at L2 (atomics bypass a stale L1), then re-zero them.
                acc = tl.atomic_add(acc_ptr, tl.zeros([BLOCK_H, D], tl.float32), mask=row_ok[:, None])
                denom = tl.atomic_add(WS_L + ws, tl.zeros([BLOCK_H], tl.float32), mask=row_ok)
                m = tl.atomic_max(WS_M + ws, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=row_ok)
                tl.store(acc_ptr, tl.zeros([BLOCK_H, D], tl.float32), mask=row_ok[:, None])
                tl.store(WS_L + ws, tl.zeros([BLOCK_H], tl.float32), mask=row_ok)
                tl.store(WS_M + ws, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=row_ok)
                tl.store(count, 0)
                _finalize(OUT, STATS, q, K, V, bt_row, b, hk, L, acc, denom, m, phi, lo_win, hi_win,
                          stride_kb, stride_kt, stride_kh, stride_ob, stride_oh, scale_log2, v_scale,
                          GROUP, BLOCK_H, D, PAGE, BLOCK_N, NUM_STAGES, PREFETCH, UPCAST, FALLBACK, PAGE_WINDOW)
        else:
            _finalize(OUT, STATS, q, K, V, bt_row, b, hk, L, acc, denom, m, phi, lo_win, hi_win,
                      stride_kb, stride_kt, stride_kh, stride_ob, stride_oh, scale_log2, v_scale,
                      GROUP, BLOCK_H, D, PAGE, BLOCK_N, NUM_STAGES, PREFETCH, UPCAST, FALLBACK, PAGE_WINDOW)


class _Workspace:
    """Zeroed accumulators per (device, shape), kept for the process: the kernel leaves them
    zeroed, and CUDA graphs capture their addresses. Warm up once before graph capture."""

    _cache: dict[tuple, tuple[torch.Tensor, ...]] = {}

    @classmethod
    def get(cls, device: torch.device, batch: int, num_heads: int, num_kv_heads: int,
            head_dim: int) -> tuple[torch.Tensor, ...]:
        key = (str(device), batch, num_heads, num_kv_heads, head_dim)
        if key not in cls._cache:
            cls._cache[key] = (
                torch.zeros(batch * num_heads * head_dim, dtype=torch.float32, device=device),
                torch.zeros(batch * num_heads, dtype=torch.float32, device=device),
                torch.full((batch * num_heads,), float("-inf"), dtype=torch.float32, device=device),
                torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=device),
            )
        return cls._cache[key]


def new_stats(device: torch.device) -> torch.Tensor:
    """A counter for `fdpp_decode(stats=...)`: stats[0] accumulates flagged (fallback) rows."""
    return torch.zeros(1, dtype=torch.int64, device=device)


@dataclass(frozen=True, eq=False)
class FdppDecodePlan:
    """The host work of one step's FlashDecoding++ decode, shared by every layer of the step (the
    layers run one after the other on one stream, and each launch leaves the workspace zeroed).

    A CUDA graph that captures `run_fdpp_decode` freezes this plan's workspaces and split count."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_dtype: torch.dtype
    estimate_phi: bool               # ESTIMATE: φ from the sink + window tokens; else every run passes phi
    max_splits: int
    min_chunk: int
    lo_win: float                    # the safe window of `row max - φ` for the P·V dtype
    hi_win: float
    consts: dict[str, Any]           # the kernel's constexprs
    launch: dict[str, Any]           # its launch options
    workspace: tuple[torch.Tensor, ...]   # (acc, denom, m, count), zeroed between launches (`_Workspace`)
    scratch_stats: torch.Tensor | None    # the counter of runs given no `stats`

    @property
    def shapes(self) -> tuple[int, ...]:
        return (self.batch, self.num_heads, self.head_dim, self.block_size, self.num_kv_heads, self.head_dim)


def plan_fdpp_decode(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     max_blocks: int, *, dtype: torch.dtype, device: torch.device,
                     kv_dtype: torch.dtype | None = None, num_splits: int | None = None, estimate_phi: bool = True,
                     fallback: bool = True, phi_sink: int = 4, phi_window: int = 28,
                     config: DecodeConfig | None = None) -> FdppDecodePlan:
    """Plan a decode of q [batch, num_heads, head_dim] (`dtype`) over pages [N, block_size, num_kv_heads,
    head_dim] (`kv_dtype`, default `dtype`) through block tables [batch, max_blocks]. `estimate_phi`: runs
    pass phi=None and φ is estimated from `phi_sink` + `phi_window` tokens (sum a power of two >= 16);
    False: every run passes its φ. `num_splits` None/0: the wave heuristic (on a GPU from the compiled
    kernel's occupancy, compiled here once per specialisation)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    cfg = config or configs_for(device).decode
    check_launch_options(cfg.extra, device)
    est_n = phi_sink + phi_window
    lo_win, hi_win = safe_window(dtype if is_fp8(kv_dtype) else kv_dtype)   # FP8 pages: P·V in q's dtype
    if batch == 0:
        return FdppDecodePlan(batch, num_heads, num_kv_heads, head_dim, block_size, dtype, kv_dtype, estimate_phi,
                              1, 0, lo_win, hi_win, {}, {}, (), None)
    if estimate_phi and (est_n < 16 or est_n & (est_n - 1)):
        raise ValueError(f"phi_sink + phi_window must be a power of two >= 16; got {est_n}")
    workspace = _Workspace.get(device, batch, num_heads, num_kv_heads, head_dim)
    group = num_heads // num_kv_heads
    min_chunk = triton.cdiv(cfg.min_chunk, cfg.block_n) * cfg.block_n
    consts = dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, BLOCK_H=rows_per_tile(group),
                  D=head_dim, PAGE=block_size, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
                  PREFETCH=cfg.prefetch, UPCAST=interpreting(), ESTIMATE=estimate_phi, EST_SINK=phi_sink,
                  EST_N=est_n, FALLBACK=bool(fallback), PAGE_WINDOW=cfg.page_window, HAS_SCALE=is_fp8(kv_dtype))
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.extra)

    def probe_args() -> tuple:
        q, kv, table, lens, stats = probe_tensors(device, dtype, kv_dtype, torch.int32, torch.int32, torch.int64)
        q_strides, kv_strides, bt_stride = contiguous_strides(batch, num_heads, num_kv_heads, head_dim, block_size,
                                                              max_blocks)
        return (q, kv, kv, table, lens, q, *workspace, stats, workspace[0], workspace[0], *q_strides, *kv_strides,
                bt_stride, *q_strides,
                LOG2E, 0.0, lo_win, hi_win, 2, min_chunk)

    max_splits = resolve_splits(num_splits, batch, num_kv_heads, device, cfg, _fdpp_kernel,
                                (dtype, kv_dtype, tuple(consts.items()), tuple(launch.items())),
                                probe_args, {**consts, **launch})
    return FdppDecodePlan(batch, num_heads, num_kv_heads, head_dim, block_size, dtype, kv_dtype, estimate_phi,
                          max_splits, min_chunk, lo_win, hi_win, consts, launch, workspace, new_stats(device))


def run_fdpp_decode(plan: FdppDecodePlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float, phi: float | None = None,
                    stats: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's decode under `plan`: out[B, Hq, D]. `phi` in scaled-score units (natural log): None
    exactly when the plan estimates φ. `stats` (int64, from `new_stats`) gains the number of rows outside
    the safe window; counting is graph-safe. The tensors must have the layouts `check_shapes` accepts
    (checked once by the caller, not here) and the plan's shapes (checked here); FP8 pages come with
    their per-head float32 `k_scale` / `v_scale` [Hkv]."""
    check_plan_shapes("fdpp decode", plan.shapes, q, k_cache)
    if plan.consts.get("HAS_SCALE") and (k_scale is None or v_scale is None):
        raise ValueError("fdpp decode: the plan is for FP8 pages, which need k_scale and v_scale")
    if (phi is None) != plan.estimate_phi:
        raise ValueError(f"this fdpp plan {'estimates' if plan.estimate_phi else 'takes'} φ; got phi={phi!r}")
    out = torch.empty_like(q) if out is None else out
    if plan.batch == 0:
        return out
    stats = plan.scratch_stats if stats is None else stats
    _fdpp_kernel[(plan.batch, plan.num_kv_heads, plan.max_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, *plan.workspace, stats,
        stats if k_scale is None else k_scale, stats if v_scale is None else v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * LOG2E,
        0.0 if phi is None else float(phi) * LOG2E, plan.lo_win, plan.hi_win, plan.max_splits, plan.min_chunk,
        **plan.consts, **plan.launch)
    return out


def fdpp_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                num_splits: int | None = None, phi: float | None = None, fallback: bool = True,
                stats: torch.Tensor | None = None, phi_sink: int = 4, phi_window: int = 28,
                config: DecodeConfig | None = None, out: torch.Tensor | None = None,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Decode with the unified-max softmax. `phi` in scaled-score units (natural log), None =
    estimate from `phi_sink` + `phi_window` tokens (sum a power of two >= 16). `stats` (int64,
    from `new_stats`) gains the number of rows outside the safe window; counting is graph-safe.
    Plans and runs.
    """
    batch, num_heads, num_kv_heads, head_dim = check_shapes(q, k_cache, v_cache, block_tables, seq_lens)
    check_scales(k_cache, k_scale, "fdpp decode")
    check_scales(v_cache, v_scale, "fdpp decode")
    plan = plan_fdpp_decode(batch, num_heads, num_kv_heads, head_dim, k_cache.shape[1], block_tables.shape[1],
                            dtype=q.dtype, device=q.device, kv_dtype=v_cache.dtype, num_splits=num_splits,
                            estimate_phi=phi is None, fallback=fallback, phi_sink=phi_sink, phi_window=phi_window,
                            config=config)
    return run_fdpp_decode(plan, q, k_cache, v_cache, block_tables, seq_lens, scale=scale, phi=phi, stats=stats,
                           out=out, k_scale=k_scale, v_scale=v_scale)
