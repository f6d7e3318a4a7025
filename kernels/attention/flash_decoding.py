"""Paged decode attention: standard (one pass) and Flash-Decoding (split-KV + exact merge), as plan + run.

Cache layout `[num_blocks, block_size, Hkv, D]` (NHD, see `kernels.attention.reference`). One program per
(sequence, KV head, split) owns all `G = Hq / Hkv` query heads of its KV head as the rows of one
tile, so each K/V byte is read once per step (`kernels.attention.splitkv`). "standard" is the same
kernel with one split: every sequence is one pass, normalised in the epilogue, and no merge runs.

`plan_flash_decode` does the host work once per step from shapes (split count, constexprs, the
partials' workspace); `run_flash_decode` launches for one layer's tensors; `flash_decode` is both.
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
from kernels.attention.splitkv import (
    LOG2E,
    attend,
    attend_tma,
    fp8_queries,
    head_scales,
    load_q_rows,
    split_plan,
    store_rows,
)
from kernels.attention.tma import has_tma, tma_descriptors
from kernels.vendor import DecodeConfig, VendorConfigs, check_launch_options, configs_for, interpreting


@triton.jit
def _split_kernel(Q, K, V, K_DESC, V_DESC, BT, SEQ, OUT, P_ACC, P_ML, K_SCALE, V_SCALE,
                  stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                  stride_ob, stride_oh, scale_log2, max_splits, min_chunk,
                  NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                  D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, UPCAST: tl.constexpr,
                  PAGE_WINDOW: tl.constexpr, HAS_SCALE: tl.constexpr, TMA: tl.constexpr):
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
        score_scale = scale_log2 * k_scale
        if HAS_SCALE:
            q = fp8_queries(q, score_scale, tl.float16, UPCAST)
            score_scale = 1.0
        if TMA:
            m, denom, acc = attend_tma(q, K, V, K_DESC, V_DESC, bt_row, lo, hi, hk, stride_kb, stride_kt, stride_kh,
                                       score_scale, score_scale, False, BLOCK_H, PAGE, BLOCK_N, D, NUM_STAGES, UPCAST)
        else:
            m, denom, acc = attend(q, K, V, bt_row, lo, hi, hk, stride_kb, stride_kt, stride_kh, score_scale,
                                   score_scale, False, BLOCK_H, PAGE, BLOCK_N, D, NUM_STAGES, PREFETCH, UPCAST,
                                   PAGE_WINDOW)
        acc = acc * v_scale
        if num_splits == 1:
            # One split (short sequence, large batch, or "standard"): normalise here, no merge.
            store_rows(OUT, acc / tl.where(denom > 0, denom, 1.0)[:, None], b, hk, stride_ob, stride_oh,
                       GROUP, BLOCK_H, D)
        else:
            rows = tl.arange(0, BLOCK_H)
            row_ok = rows < GROUP
            part = (b.to(tl.int64) * NUM_HEADS + hk * GROUP + rows) * max_splits + split
            tl.store(P_ACC + part[:, None] * D + tl.arange(0, D)[None, :], acc, mask=row_ok[:, None])
            tl.store(P_ML + part * 2, m, mask=row_ok)
            tl.store(P_ML + part * 2 + 1, denom, mask=row_ok)


@triton.jit
def _merge_kernel(SEQ, OUT, P_ACC, P_ML, stride_ob, stride_oh, max_splits, min_chunk,
                  NUM_HEADS: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                  SPLITS_POW2: tl.constexpr):
    """Exact log-sum-exp merge of one query row's split partials.

    All splits are loaded at once and reduced in registers (a fixed-order tree, so the result
    is deterministic): a loop over splits would chain one L2 round trip per split.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    L = tl.load(SEQ + b)
    _, num_splits = split_plan(L, max_splits, min_chunk, BLOCK_N)
    if num_splits > 1:
        split = tl.arange(0, SPLITS_POW2)
        ok = split < num_splits
        part = (b.to(tl.int64) * NUM_HEADS + h) * max_splits + split
        m = tl.load(P_ML + part * 2, mask=ok, other=float("-inf"))
        denom = tl.load(P_ML + part * 2 + 1, mask=ok, other=0.0)
        acc = tl.load(P_ACC + part[:, None] * D + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
        w = tl.exp2(m - tl.max(m, 0))
        out = tl.sum(acc * w[:, None], 0) / tl.sum(denom * w, 0)
        ptr = OUT + b.to(tl.int64) * stride_ob + h * stride_oh + tl.arange(0, D)
        tl.store(ptr, out.to(OUT.dtype.element_ty))


# ----- host side -------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class FlashDecodePlan:
    """The host work of one step's flash / standard decode, shared by every layer of the step (the
    layers run one after the other on one stream, so they can share the partials' workspace).

    A CUDA graph that captures `run_flash_decode` freezes this plan's workspaces and split count."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    max_splits: int                   # 1: every sequence takes the one-split epilogue, no merge
    min_chunk: int
    consts: dict[str, Any]            # the split kernel's constexprs
    launch: dict[str, Any]            # its launch options
    merge_options: dict[str, Any]     # the merge kernel's constexprs and launch options
    p_acc: torch.Tensor | None        # [B * Hq * max_splits * D] fp32 partial numerators (None: one split)
    p_ml: torch.Tensor | None         # [B * Hq * max_splits * 2] fp32 partial (max, sum)
    tma: bool = False                 # whole tiles by TMA copies where the caches allow it

    @property
    def shapes(self) -> tuple[int, ...]:
        return (self.batch, self.num_heads, self.head_dim, self.block_size, self.num_kv_heads, self.head_dim)


def plan_flash_decode(batch: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                      max_blocks: int, *, dtype: torch.dtype, device: torch.device,
                      kv_dtype: torch.dtype | None = None, num_splits: int | None = None,
                      config: DecodeConfig | None = None) -> FlashDecodePlan:
    """Plan a decode of q [batch, num_heads, head_dim] (`dtype`) over pages [N, block_size, num_kv_heads,
    head_dim] (`kv_dtype`, default `dtype`) through block tables [batch, max_blocks]. `num_splits` 1 is
    the standard single pass; None/0 the wave heuristic, which on a GPU reads the compiled kernel's
    occupancy (compiled here, once per specialisation)."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    cfg = config or decode_config(configs_for(device), device, kv_dtype, block_size, one_split=num_splits == 1)
    check_launch_options(cfg.extra, device)
    group = num_heads // num_kv_heads
    min_chunk = triton.cdiv(cfg.min_chunk, cfg.block_n) * cfg.block_n
    consts = dict(NUM_HEADS=num_heads, GROUP=group, BLOCK_H=rows_per_tile(group), D=head_dim,
                  PAGE=block_size, BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
                  PREFETCH=cfg.prefetch, UPCAST=interpreting(), PAGE_WINDOW=cfg.page_window,
                  HAS_SCALE=is_fp8(kv_dtype))
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.extra)

    def probe_args() -> tuple:
        q, kv, table, lens, partial = probe_tensors(device, dtype, kv_dtype, torch.int32, torch.int32, torch.float32)
        q_strides, kv_strides, bt_stride = contiguous_strides(batch, num_heads, num_kv_heads, head_dim, block_size,
                                                              max_blocks)
        return (q, kv, kv, kv, kv, table, lens, q, partial, partial, partial, partial, *q_strides, *kv_strides,
                bt_stride,
                *q_strides, LOG2E, 2, min_chunk)

    if batch == 0 or num_splits == 1:
        max_splits = 1
    else:
        max_splits = resolve_splits(num_splits, batch, num_kv_heads, device, cfg, _split_kernel,
                                    (dtype, kv_dtype, tuple(consts.items()), tuple(launch.items())),
                                    probe_args, {**consts, "TMA": False, **launch})
    p_acc = p_ml = None
    if max_splits > 1:
        p_acc = torch.empty(batch * num_heads * max_splits * head_dim, dtype=torch.float32, device=device)
        p_ml = torch.empty(batch * num_heads * max_splits * 2, dtype=torch.float32, device=device)
    merge_options = dict(NUM_HEADS=num_heads, D=head_dim, BLOCK_N=cfg.block_n,
                         SPLITS_POW2=triton.next_power_of_2(max_splits), num_warps=cfg.merge_warps, **cfg.extra)
    return FlashDecodePlan(batch, num_heads, num_kv_heads, head_dim, block_size, dtype, max_splits, min_chunk,
                           consts, launch, merge_options, p_acc, p_ml, cfg.tma)


def decode_config(configs: VendorConfigs, device: torch.device, kv_dtype: torch.dtype, block_size: int, *,
                  one_split: bool = False) -> DecodeConfig:
    """`configs`' flash / standard launch shape for these pages: FP8 pages take the TMA shape where the GPU
    has TMA copies and a page holds whole tiles of it. `one_split` (standard: one program a sequence and KV
    head) keeps the shared shape: the FP8 shapes are many one-warp programs, which needs the splits."""
    if one_split:
        return configs.decode
    tma_shape = configs.decode_for(kv_dtype, tma=True)
    fits = tma_shape.tma and block_size % tma_shape.block_n == 0 and has_tma(device)
    return tma_shape if fits else configs.decode_for(kv_dtype)


def run_flash_decode(plan: FlashDecodePlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                     out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's decode under `plan`: out[B, Hq, D]. The tensors must have the layouts `check_shapes`
    accepts (checked once by the caller, not here) and the plan's shapes (checked here); FP8 pages
    come with their per-head float32 `k_scale` / `v_scale` [Hkv]."""
    check_plan_shapes("flash decode", plan.shapes, q, k_cache)
    if plan.consts["HAS_SCALE"] and (k_scale is None or v_scale is None):
        raise ValueError("flash decode: the plan is for FP8 pages, which need k_scale and v_scale")
    out = torch.empty_like(q) if out is None else out
    if plan.batch == 0:
        return out
    # one split: the partials are never touched, any pointer will do
    p_acc, p_ml = (out, out) if plan.p_acc is None else (plan.p_acc, plan.p_ml)
    descriptors = tma_descriptors(k_cache, v_cache, plan.consts["BLOCK_N"], plan.tma)
    k_desc, v_desc = descriptors or (k_cache, v_cache)
    _split_kernel[(plan.batch, plan.num_kv_heads, plan.max_splits)](
        q, k_cache, v_cache, k_desc, v_desc, block_tables, seq_lens, out, p_acc, p_ml,
        p_ml if k_scale is None else k_scale, p_ml if v_scale is None else v_scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), scale * LOG2E, plan.max_splits, plan.min_chunk,
        **plan.consts, TMA=descriptors is not None, **plan.launch)
    if plan.max_splits > 1:
        _merge_kernel[(plan.batch, plan.num_heads)](
            seq_lens, out, p_acc, p_ml, out.stride(0), out.stride(1), plan.max_splits, plan.min_chunk,
            **plan.merge_options)
    return out


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                 num_splits: int | None = None, config: DecodeConfig | None = None,
                 out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Flash-Decoding; `num_splits` = 1 is the standard single pass (no merge launch). Plans and runs."""
    batch, num_heads, num_kv_heads, head_dim = check_shapes(q, k_cache, v_cache, block_tables, seq_lens)
    check_scales(k_cache, k_scale, "flash decode")
    check_scales(v_cache, v_scale, "flash decode")
    plan = plan_flash_decode(batch, num_heads, num_kv_heads, head_dim, k_cache.shape[1], block_tables.shape[1],
                             dtype=q.dtype, device=q.device, kv_dtype=k_cache.dtype, num_splits=num_splits,
                             config=config)
    return run_flash_decode(plan, q, k_cache, v_cache, block_tables, seq_lens, scale=scale, out=out,
                            k_scale=k_scale, v_scale=v_scale)
