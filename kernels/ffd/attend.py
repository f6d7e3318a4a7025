"""FFD decode, launches 2 and 3 (`kernels/ffd/decode.py` describes the decode): the attend over the kept
blocks (and the exact tail, and "auto"'s dense rows), then the split-KV log-sum-exp merge.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.ffd.tiles import (
    _exact_tile,
    _load_codes,
    _load_residual,
    _load_rows_q,
    _load_scales,
    _online,
    _page_tile,
    _quantized_len,
    _refined_dots,
    _release_next,
    _wait_previous,
)

# ----- decode 2: attend over the kept blocks -------------------------------------------------

@triton.jit
def _flag_chunk(flag_row, c, nq, CHUNK: tl.constexpr):
    """Chunk c of a (sequence, KV head)'s flag row: page ids (-1 = dropped or past nq), keep 1/0."""
    idx = c * CHUNK + tl.arange(0, CHUNK)
    page = tl.load(flag_row + idx, mask=idx < nq, other=-1)
    return page, (page >= 0).to(tl.int32)


@triton.jit
def _scatter_mine(page, keep, base, lo, n_mine, slot_row):
    """slot_row[r - lo] = page of the kept block of rank r, for r in [lo, lo + n_mine); ranks are
    exclusive prefix sums of the keep flags (base: kept blocks before this chunk), so the kept
    blocks keep their order."""
    rank = base + tl.cumsum(keep, 0) - keep
    mine = (keep > 0) & (rank >= lo) & (rank < lo + n_mine)
    tl.store(slot_row + (rank - lo), page, mask=mine)


@triton.jit
def _kept_block(q0, q1, q2, q3, CODES, SCALES, RES, V, page, hk, stride_kb, stride_kt, stride_kh,
                NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                D4: tl.constexpr, UPCAST: tl.constexpr):
    """Refined raw scores [BLOCK_H, BS] and the V tile of one kept block; all loads go out first."""
    qbase = page * NUM_KV_HEADS + hk
    s0, s1, s2, s3 = _load_scales(SCALES, qbase, D, D4)
    byte = _load_codes(CODES, qbase, BS, D4)
    r0, r1, r2, r3 = _load_residual(RES, qbase, BS, D, D4)
    v = _page_tile(V, page, hk, stride_kb, stride_kt, stride_kh, tl.arange(0, BS) < BS, BS, D, UPCAST)
    return _refined_dots(q0, q1, q2, q3, s0, s1, s2, s3, byte, r0, r1, r2, r3, BLOCK_H, BS, UPCAST), v


@triton.jit
def _attend_kernel(Q, K, V, KMAP, CODES, SCALES, RES, BT, SEQ, FLAGS, SLOTS, P_ACC, P_ML, STATS, KEPT_TOTAL,
                   stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, max_blocks,
                   scale_log2, min_ffd_len, resident,
                   NUM_SPLITS: tl.constexpr, MIN_PER_SPLIT: tl.constexpr, DENSE_MIN_PER_SPLIT: tl.constexpr,
                   PER_MAX: tl.constexpr,
                   FLAG_CHUNK: tl.constexpr, ONE_CHUNK: tl.constexpr, NUM_HEADS: tl.constexpr,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                   D4: tl.constexpr, BS: tl.constexpr, UPCAST: tl.constexpr, COUNT: tl.constexpr,
                   HAS_KMAP: tl.constexpr, PDL: tl.constexpr):
    """Partial (m, denom, acc) of one split. Kept blocks: ranks [split * per, split * per + n_mine) with
    per = max(ceil(kept / NUM_SPLITS), MIN_PER_SPLIT, min(ceil(KEPT_TOTAL / resident), PER_MAX))
    <= PER_MAX (see `attend_slots`), so the splits cover every kept block exactly once. The last
    term (resident > 0) makes the batch's busy splits one round: with resident = the programs the
    GPU runs at once minus the rows (B * Hkv), sum over rows of ceil(kept / per) <= KEPT_TOTAL / per
    + rows <= the programs the GPU runs at once. "auto" rows below the crossover: pages
    [split * per, (split + 1) * per) of the exact keys instead. ONE_CHUNK: the whole flag row fits
    one FLAG_CHUNK load, read once for both the count and the ranks."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    _release_next(PDL)
    L = tl.load(SEQ + b)
    dense = L < min_ffd_len
    nq = _quantized_len(L, min_ffd_len, BS)
    rows = tl.arange(0, BLOCK_H)
    row_ok = rows < GROUP
    heads = hk * GROUP + rows
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_bt
    row = b.to(tl.int64) * NUM_KV_HEADS + hk
    # q first: its loads overlap the flag row's instead of following the split's work decision
    q, q0, q1, q2, q3 = _load_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP, BLOCK_H, D, D4, UPCAST)
    _wait_previous(PDL)                         # the scan's flags and kept-block total
    if dense:
        # "auto" below the crossover: dense split-KV over the exact keys (Flash-Decoding)
        pages = tl.cdiv(L, BS)
        per = tl.maximum(tl.cdiv(pages, NUM_SPLITS), DENSE_MIN_PER_SPLIT)
        lo = split * per
        hi = tl.minimum(lo + per, pages)
        for blk in range(lo, hi):
            raw, v, valid = _exact_tile(q, K, V, KMAP, bt_row, blk, L, hk, stride_kb, stride_kt, stride_kh, BS, D,
                                        UPCAST, HAS_KMAP)
            m, denom, acc = _online(m, denom, acc, tl.where(valid[None, :], raw * scale_log2, float("-inf")), v)
    else:
        flag_row = FLAGS + row * max_blocks
        kept_total = tl.load(KEPT_TOTAL)                # issued beside the flag row's loads, not after them
        if ONE_CHUNK:
            page_row, keep_row = _flag_chunk(flag_row, 0, nq, FLAG_CHUNK)
            kept = tl.sum(keep_row, 0)
        else:
            kept = nq * 0
            for c in range(tl.cdiv(nq, FLAG_CHUNK)):
                kept += tl.sum(_flag_chunk(flag_row, c, nq, FLAG_CHUNK)[1], 0)
        per = tl.maximum(tl.cdiv(kept, NUM_SPLITS), MIN_PER_SPLIT)
        if resident > 0:
            per = tl.maximum(per, tl.minimum(tl.cdiv(kept_total, resident), PER_MAX))
        lo = split * per
        n_mine = tl.minimum(tl.maximum(kept - lo, 0), per)
        if n_mine > 0:
            slot_row = SLOTS + (row * NUM_SPLITS + split) * PER_MAX
            if ONE_CHUNK:
                _scatter_mine(page_row, keep_row, 0, lo, n_mine, slot_row)
            else:
                base = nq * 0
                for c in range(tl.cdiv(nq, FLAG_CHUNK)):
                    page_c, keep_c = _flag_chunk(flag_row, c, nq, FLAG_CHUNK)
                    _scatter_mine(page_c, keep_c, base, lo, n_mine, slot_row)
                    base += tl.sum(keep_c, 0)
            tl.debug_barrier()                          # the slot row was written by other threads
            slots = tl.arange(0, PER_MAX)
            my_pages = tl.load(slot_row + slots, mask=slots < n_mine, other=0)
            for i in range(n_mine):                     # no data-dependent branch inside
                page = tl.sum(tl.where(slots == i, my_pages, 0), 0).to(tl.int64)
                raw, v = _kept_block(q0, q1, q2, q3, CODES, SCALES, RES, V, page, hk, stride_kb, stride_kt,
                                     stride_kh, NUM_KV_HEADS, BLOCK_H, BS, D, D4, UPCAST)
                m, denom, acc = _online(m, denom, acc, raw * scale_log2, v)
        if (split == NUM_SPLITS - 1) & (L > nq * BS):   # the exact tail, once per sequence
            raw, v, valid = _exact_tile(q, K, V, KMAP, bt_row, nq, L, hk, stride_kb, stride_kt, stride_kh, BS, D,
                                        UPCAST, HAS_KMAP)
            m, denom, acc = _online(m, denom, acc, tl.where(valid[None, :], raw * scale_log2, float("-inf")), v)
        if COUNT:   # once per (sequence, KV head); read after the launch, so no fence
            tl.atomic_add(STATS, nq.to(tl.int64), mask=split == 0, sem="relaxed")
            tl.atomic_add(STATS + 1, kept.to(tl.int64), mask=split == 0, sem="relaxed")
    part = (b.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split
    tl.store(P_ML + part * 2, m, mask=row_ok)
    tl.store(P_ML + part * 2 + 1, denom, mask=row_ok)
    # an empty split's acc is never read (the merge masks it by m = -inf): no store
    tl.store(P_ACC + part[:, None] * D + tl.arange(0, D)[None, :], acc,
             mask=(row_ok & (m > float("-inf")))[:, None])


# ----- decode 3: merge -----------------------------------------------------------------------

@triton.jit
def _merge_kernel(OUT, P_ACC, P_ML, SYNC, stride_ob, stride_oh, NUM_SPLITS: tl.constexpr,
                  NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, DC: tl.constexpr,
                  PDL: tl.constexpr):
    """Log-sum-exp merge of one (sequence, query head)'s splits over channels [c * DC, (c + 1) * DC).

    All splits at once (one round trip for m, denom, one for acc); empty splits (m = -inf) weigh 0 and
    their acc is not read. A row with no token at all (L = 0) gets 0. The decode's counters are
    zeroed for the next call here, where the scan (READY) and the attend (the kept-block total) have
    finished: program (0, 0, 0) the total, the first program of each (sequence, KV head) its READY."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    base = (b.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS
    _wait_previous(PDL)
    tl.store(SYNC, 0, mask=(b == 0) & (h == 0) & (c == 0))
    tl.store(SYNC + 1 + b.to(tl.int64) * NUM_KV_HEADS + h // GROUP, 0, mask=(h % GROUP == 0) & (c == 0))
    s = base + tl.arange(0, NUM_SPLITS)
    m_s = tl.load(P_ML + s * 2)
    l_s = tl.load(P_ML + s * 2 + 1)
    used = m_s > float("-inf")
    m_all = tl.max(m_s, 0)
    w = tl.where(used, tl.exp2(m_s - tl.where(m_all > float("-inf"), m_all, 0.0)), 0.0)
    l_all = tl.sum(w * l_s, 0)
    cols = c * DC + tl.arange(0, DC)
    a = tl.load(P_ACC + s[:, None] * D + cols[None, :], mask=used[:, None], other=0.0)
    out = tl.sum(a * w[:, None], 0) / tl.where(l_all > 0, l_all, 1.0)
    tl.store(OUT + b.to(tl.int64) * stride_ob + h * stride_oh + cols, out.to(OUT.dtype.element_ty))
