"""Paged decode attention: standard (one pass) and Flash-Decoding (split-KV + exact merge).

Cache layout `[num_blocks, block_size, Hkv, D]` (NHD, see `kernels.attention.reference`). One program per
(sequence, KV head, split) owns all `G = Hq / Hkv` query heads of its KV head as the rows of one
tile (padded to 16, the `tl.dot` minimum), so each K/V byte is read once per step.

Splits are graph-safe: the host picks only `max_splits` (from the batch size and the SM count,
FA2's wave-efficiency rule); each program derives its sequence's chunk from `seq_lens` on the
device (`split_plan`) and programs past the last split exit. "standard" is the same kernel with
one split: every sequence is one pass, normalised in the epilogue, and no merge runs.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.occupancy import resident_ctas
from kernels.vendor import DecodeConfig, check_launch_options, configs_for, interpreting, num_compute_units

LOG2E = 1.4426950408889634
MAX_SPLITS = 128   # the merge holds all of a row's partials in registers


# ----- device helpers shared with kernels/attention/fdpp.py ---------------------------------------------

@triton.jit
def split_plan(L, max_splits, min_chunk, BLOCK_N: tl.constexpr):
    """(chunk, num_splits) of one sequence; mirrors `kernels.attention.reference.split_plan`."""
    chunk = tl.cdiv(tl.cdiv(L, max_splits), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, min_chunk)           # host rounds min_chunk to a multiple of BLOCK_N
    return chunk, tl.maximum(tl.cdiv(L, chunk), 1)


@triton.jit
def kv_token_offsets(bt_row, start, hi, offs, valid, stride_kb, stride_kt,
                     PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 element offsets of tokens `offs` (the tile starting at `start`) in the paged cache."""
    if PAGE >= BLOCK_N:
        # Powers of two and BLOCK_N-aligned tiles: the tile sits in one page, one table read.
        page = tl.load(bt_row + start // PAGE, mask=start < hi, other=0).to(tl.int64)
    else:
        page = tl.load(bt_row + offs // PAGE, mask=valid, other=0).to(tl.int64)
    return page * stride_kb + (offs % PAGE).to(tl.int64) * stride_kt


@triton.jit
def tile_tokens(bt_row, start, hi, hk, stride_kb, stride_kt, stride_kh,
                PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Offsets of head `hk` of tokens [start, start + BLOCK_N) and the mask of those < hi."""
    offs = start + tl.arange(0, BLOCK_N)
    valid = offs < hi
    tok = kv_token_offsets(bt_row, start, hi, offs, valid, stride_kb, stride_kt, PAGE, BLOCK_N)
    return tok + hk * stride_kh, valid


@triton.jit
def load_tile(K, V, tok, valid, D: tl.constexpr, UPCAST: tl.constexpr):
    """K and V [BLOCK_N, D]. Masked tokens read as 0: unwritten cache memory may hold NaN bit
    patterns, and 0·NaN = NaN in P·V."""
    ptr = tok[:, None] + tl.arange(0, D)[None, :]
    k = tl.load(K + ptr, mask=valid[:, None], other=0.0)
    v = tl.load(V + ptr, mask=valid[:, None], other=0.0)
    if UPCAST:   # the interpreter mis-computes bf16 arithmetic
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def load_kv_tile(K, V, bt_row, start, hi, hk, stride_kb, stride_kt, stride_kh,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr):
    tok, valid = tile_tokens(bt_row, start, hi, hk, stride_kb, stride_kt, stride_kh, PAGE, BLOCK_N)
    k, v = load_tile(K, V, tok, valid, D, UPCAST)
    return k, v, valid


@triton.jit
def load_q_rows(Q, b, hk, stride_qb, stride_qh, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                D: tl.constexpr, UPCAST: tl.constexpr):
    """The G query heads of KV head `hk` as rows [BLOCK_H, D] (padding rows are zero)."""
    rows = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    heads = hk * GROUP + rows
    q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=(rows < GROUP)[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def softmax_step(q, k, v, valid, m, l, acc, phi, scale_log2, ASYNC: tl.constexpr):
    """Fold one KV tile into (m, l, acc), log2 units.

    Exact: online softmax, rescaling l and acc whenever the running max m grows.
    ASYNC (FD++): exponentiate against the unified max φ; no rescale. m is then only the true
    row max, kept (one reduction, no exponential) for the range check.
    """
    s = tl.where(valid[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf"))
    if ASYNC:
        m = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - phi[:, None])
        l += tl.sum(p, 1)
        acc += tl.dot(p.to(v.dtype), v)
    else:
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return m, l, acc


@triton.jit
def window_tokens(PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_WINDOW: tl.constexpr):
    """Tokens per page window: BLOCK_N-aligned windows touch at most PAGE_WINDOW pages."""
    if PAGE <= BLOCK_N:
        return PAGE_WINDOW * PAGE
    else:
        return (PAGE_WINDOW - 1) * PAGE


@triton.jit
def attend(q, K, V, bt_row, lo, hi, hk, stride_kb, stride_kt, stride_kh, scale_log2, phi,
           ASYNC: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
           D: tl.constexpr, NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, UPCAST: tl.constexpr,
           PAGE_WINDOW: tl.constexpr):
    """(m, l, acc) of the rows `q` over tokens [lo, hi) (see `softmax_step`). Three loops:

    default: the page id is read inside the tile loop. Triton's pipeliner then keeps a single
        K/V buffer and waits for each tile; several resident CTAs per SM hide the latency, and
        on the H200 this is the fastest of the three (bench/RESULTS.md).
    PAGE_WINDOW: page ids of a window of pages are loaded into registers first, so the tile
        loop is pipelined with real multi-buffering; the buffers cost occupancy.
    PREFETCH: the next tile's K/V (and the page ids of the one after) are loaded in registers
        one iteration early; for targets where num_stages = 1 leaves no Triton pipelining.
    """
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    if PAGE_WINDOW > 0:
        # One page-table load per window: the tile loop then holds no load that feeds another
        # load's address, and Triton pipelines the K/V copies (TTGIR async_wait num=2, not 0).
        pidx = tl.arange(0, PAGE_WINDOW)
        for w_lo in range(lo, hi, window_tokens(PAGE, BLOCK_N, PAGE_WINDOW)):
            w_hi = tl.minimum(w_lo + window_tokens(PAGE, BLOCK_N, PAGE_WINDOW), hi)
            first = w_lo // PAGE
            pages = tl.load(bt_row + first + pidx, mask=(first + pidx) * PAGE < w_hi, other=0).to(tl.int64)
            for start in tl.range(w_lo, w_hi, BLOCK_N, num_stages=NUM_STAGES):
                offs = start + tl.arange(0, BLOCK_N)
                valid = offs < w_hi
                if PAGE >= BLOCK_N:
                    page = tl.sum(tl.where(pidx == start // PAGE - first, pages, 0), 0)
                    tok = page * stride_kb
                else:
                    NPT: tl.constexpr = BLOCK_N // PAGE
                    j = (start // PAGE - first) + tl.arange(0, NPT)
                    tile_pages = tl.sum(tl.where(pidx[None, :] == j[:, None], pages[None, :], 0), 1)
                    tok = tl.reshape(tl.broadcast_to(tile_pages[:, None], [NPT, PAGE]), [BLOCK_N]) * stride_kb
                tok += (offs % PAGE).to(tl.int64) * stride_kt + hk * stride_kh
                k, v = load_tile(K, V, tok, valid, D, UPCAST)
                m, l, acc = softmax_step(q, k, v, valid, m, l, acc, phi, scale_log2, ASYNC)
    elif PREFETCH:
        tok, valid = tile_tokens(bt_row, lo, hi, hk, stride_kb, stride_kt, stride_kh, PAGE, BLOCK_N)
        k, v = load_tile(K, V, tok, valid, D, UPCAST)
        tok_n, valid_n = tile_tokens(bt_row, lo + BLOCK_N, hi, hk, stride_kb, stride_kt, stride_kh,
                                     PAGE, BLOCK_N)
        for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            k_n, v_n = load_tile(K, V, tok_n, valid_n, D, UPCAST)
            tok_nn, valid_nn = tile_tokens(bt_row, start + 2 * BLOCK_N, hi, hk, stride_kb, stride_kt,
                                           stride_kh, PAGE, BLOCK_N)
            m, l, acc = softmax_step(q, k, v, valid, m, l, acc, phi, scale_log2, ASYNC)
            k = k_n
            v = v_n
            valid = valid_n
            tok_n = tok_nn
            valid_n = valid_nn
    else:
        for start in tl.range(lo, hi, BLOCK_N, num_stages=NUM_STAGES):
            k, v, valid = load_kv_tile(K, V, bt_row, start, hi, hk, stride_kb, stride_kt, stride_kh,
                                       PAGE, BLOCK_N, D, UPCAST)
            m, l, acc = softmax_step(q, k, v, valid, m, l, acc, phi, scale_log2, ASYNC)
    return m, l, acc


@triton.jit
def store_rows(OUT, out, b, hk, stride_ob, stride_oh, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
               D: tl.constexpr):
    rows = tl.arange(0, BLOCK_H)
    heads = hk * GROUP + rows
    ptr = OUT + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + tl.arange(0, D)[None, :]
    tl.store(ptr, out.to(OUT.dtype.element_ty), mask=(rows < GROUP)[:, None])


# ----- kernels ---------------------------------------------------------------------------------

@triton.jit
def _split_kernel(Q, K, V, BT, SEQ, OUT, P_ACC, P_ML,
                  stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                  stride_ob, stride_oh, scale_log2, max_splits, min_chunk,
                  NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                  D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_STAGES: tl.constexpr, PREFETCH: tl.constexpr, UPCAST: tl.constexpr,
                  PAGE_WINDOW: tl.constexpr):
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
        m, l, acc = attend(q, K, V, bt_row, lo, hi, hk, stride_kb, stride_kt, stride_kh, scale_log2,
                           scale_log2, False, BLOCK_H, PAGE, BLOCK_N, D, NUM_STAGES, PREFETCH, UPCAST,
                           PAGE_WINDOW)
        if num_splits == 1:
            # One split (short sequence, large batch, or "standard"): normalise here, no merge.
            store_rows(OUT, acc / tl.where(l > 0, l, 1.0)[:, None], b, hk, stride_ob, stride_oh,
                       GROUP, BLOCK_H, D)
        else:
            rows = tl.arange(0, BLOCK_H)
            row_ok = rows < GROUP
            part = (b.to(tl.int64) * NUM_HEADS + hk * GROUP + rows) * max_splits + split
            tl.store(P_ACC + part[:, None] * D + tl.arange(0, D)[None, :], acc, mask=row_ok[:, None])
            tl.store(P_ML + part * 2, m, mask=row_ok)
            tl.store(P_ML + part * 2 + 1, l, mask=row_ok)


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
        l = tl.load(P_ML + part * 2 + 1, mask=ok, other=0.0)
        acc = tl.load(P_ACC + part[:, None] * D + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0)
        w = tl.exp2(m - tl.max(m, 0))
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        ptr = OUT + b.to(tl.int64) * stride_ob + h * stride_oh + tl.arange(0, D)
        tl.store(ptr, out.to(OUT.dtype.element_ty))


# ----- host side -------------------------------------------------------------------------------

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


def rows_per_tile(group: int) -> int:
    return max(16, triton.next_power_of_2(group))


def resolve_splits(num_splits: int | None, batch: int, num_kv_heads: int, device: torch.device,
                   cfg: DecodeConfig, kernel: Any, key: tuple, args: tuple, kwargs: dict[str, Any]) -> int:
    """Forced `num_splits`, or the wave heuristic for the kernel's resident CTAs per SM
    (`cfg.ctas_per_sm`, or 0: measured from the compiled kernel; 2 in the interpreter)."""
    if num_splits:
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}; got {num_splits}")
        return int(num_splits)
    ctas = cfg.ctas_per_sm
    if not ctas:
        ctas = 2 if device.type != "cuda" else resident_ctas(kernel, key, args, kwargs, device)
    return choose_num_splits(batch, num_kv_heads, num_compute_units(device), ctas, cfg.max_splits)


def flash_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                 num_splits: int | None = None, config: DecodeConfig | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Flash-Decoding; `num_splits` = 1 is the standard single pass (no merge launch)."""
    batch, num_heads, num_kv_heads, head_dim = check_shapes(q, k_cache, v_cache, block_tables, seq_lens)
    cfg = config or configs_for(q.device).decode
    check_launch_options(cfg.extra, q.device)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    min_chunk = triton.cdiv(cfg.min_chunk, cfg.block_n) * cfg.block_n
    consts = dict(NUM_HEADS=num_heads, GROUP=group, BLOCK_H=rows_per_tile(group), D=head_dim,
                  PAGE=k_cache.shape[1], BLOCK_N=cfg.block_n, NUM_STAGES=cfg.num_stages,
                  PREFETCH=cfg.prefetch, UPCAST=interpreting(), PAGE_WINDOW=cfg.page_window)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **cfg.extra)

    def args(p_acc, p_ml, max_splits):
        return (q, k_cache, v_cache, block_tables, seq_lens, out, p_acc, p_ml,
                q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                block_tables.stride(0), out.stride(0), out.stride(1), scale * LOG2E, max_splits, min_chunk)

    probe = torch.empty(1, dtype=torch.float32, device=q.device)
    max_splits = 1 if num_splits == 1 else resolve_splits(
        num_splits, batch, num_kv_heads, q.device, cfg, _split_kernel,
        (q.dtype, k_cache.dtype, tuple(consts.items()), tuple(launch.items())),
        args(probe, probe, 2), {**consts, **launch})
    if max_splits > 1:
        p_acc = torch.empty(batch * num_heads * max_splits * head_dim, dtype=torch.float32, device=q.device)
        p_ml = torch.empty(batch * num_heads * max_splits * 2, dtype=torch.float32, device=q.device)
    else:
        p_acc = p_ml = out   # never touched: every sequence takes the one-split epilogue
    _split_kernel[(batch, num_kv_heads, max_splits)](*args(p_acc, p_ml, max_splits), **consts, **launch)
    if max_splits > 1:
        _merge_kernel[(batch, num_heads)](
            seq_lens, out, p_acc, p_ml, out.stride(0), out.stride(1), max_splits, min_chunk,
            NUM_HEADS=num_heads, D=head_dim, BLOCK_N=cfg.block_n,
            SPLITS_POW2=triton.next_power_of_2(max_splits), num_warps=cfg.merge_warps, **cfg.extra)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, *, scale: float,
                     variant: str, num_splits: int | None = None, **options) -> torch.Tensor:
    """The one decode entry point: q[B,Hq,D] over paged KV -> out[B,Hq,D] (Triton).

    variant "standard": one pass over each sequence's whole KV (no split, no merge);
    "flash": split-KV with the exact log-sum-exp merge (`num_splits` None/0 = heuristic);
    "fdpp": asynchronous softmax with a unified max φ (options of `kernels.attention.fdpp.fdpp_decode`).
    `kernels.attention.reference.decode_reference` is the same signature in torch.
    """
    if variant == "standard":
        return flash_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, num_splits=1, **options)
    if variant == "flash":
        return flash_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                            num_splits=num_splits, **options)
    if variant == "fdpp":
        from kernels.attention.fdpp import fdpp_decode
        return fdpp_decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                           num_splits=num_splits, **options)
    raise ValueError(f"unknown decode variant {variant!r}; expected 'standard', 'flash' or 'fdpp'")
