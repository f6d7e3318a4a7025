"""FFD decode, launch 1 (`kernels/ffd/decode.py` describes the decode): the threshold (pseudo-max programs)
and the 2-bit scan that turns each full block's score bound into a keep flag.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.attention.kv_store import key_page
from kernels.ffd.ptx import (
    INT8_Q_MAX,
    INT_ROUND,
    INT_ROUND_BITS,
    SCAN_ASM_0,
    SCAN_ASM_1,
    SCAN_ASM_2,
    SCAN_ASM_3,
)
from kernels.ffd.tiles import (
    _code_plane,
    _in_window,
    _load_q_planes,
    _load_rows_q,
    _plane_of,
    _plane_term,
    _quant_scores,
    _release_next,
    _token_rows,
)

# ----- decode 1, first programs: threshold ----------------------------------------------------

@triton.jit
def _pseudo_max_part(Q, K, V, KMAP, CODES, SCALES, RES, BT, PM, b, hk, z, L,
                     stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                     scale_log2, sink, window,
                     SINK_PARTS: tl.constexpr, NUM_PARTS: tl.constexpr, NUM_HEADS: tl.constexpr,
                     NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
                     D4: tl.constexpr, BS: tl.constexpr, SLICE: tl.constexpr, UPCAST: tl.constexpr,
                     HAS_KMAP: tl.constexpr):
    """Slice z % SLICES (SLICE tokens) of part z // SLICES of the pseudo-max of (sequence b, KV head
    hk): part p < SINK_PARTS is sink block p, then the window's blocks, the last part the exact tail.
    It writes the row max over its tokens in the sinks or the window to PM[b, head, z]. Slices keep
    each program's tiles small: these programs share the scan's one-warp launch. Rows below
    min_ffd_len never get here (`_scan_kernel` returns first)."""
    SLICES: tl.constexpr = BS // SLICE
    part = z // SLICES
    sl = z % SLICES
    nq = L // BS
    rows = tl.arange(0, BLOCK_H)
    toks = sl * SLICE + tl.arange(0, SLICE)
    best = tl.full([BLOCK_H], float("-inf"), tl.float32)
    q, q0, q1, q2, q3 = _load_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP, BLOCK_H, D, D4, UPCAST)
    bt_row = BT + b.to(tl.int64) * stride_bt
    if part == NUM_PARTS - 1:
        page = tl.load(bt_row + nq, mask=nq * BS < L, other=0).to(tl.int64)   # the tail may be empty
        valid = nq * BS + toks < L
        k = _token_rows(K, key_page(KMAP, page, HAS_KMAP), hk, toks, stride_kb, stride_kt, stride_kh, valid, D,
                        UPCAST)
        ok = valid & _in_window(nq * BS + toks, L, sink, window)
        best = tl.max(tl.where(ok[None, :], tl.dot(q, tl.trans(k)) * scale_log2, float("-inf")), 1)
    else:
        sink_blocks = tl.minimum(tl.cdiv(sink, BS), nq)
        first_window = tl.maximum(tl.maximum(L - window, 0) // BS, sink_blocks)
        blk = tl.where(part < SINK_PARTS, part, first_window + part - SINK_PARTS)
        useful = tl.where(part < SINK_PARTS, blk < sink_blocks, blk < nq)
        if useful:
            page = tl.load(bt_row + blk)
            zs = _quant_scores(q0, q1, q2, q3, CODES, SCALES, RES, page, hk, sl, NUM_KV_HEADS, BLOCK_H, SLICE,
                               SLICES, D, D4, True, UPCAST) * scale_log2
            best = tl.max(tl.where(_in_window(blk * BS + toks, L, sink, window)[None, :], zs, float("-inf")), 1)
    heads = hk * GROUP + rows
    tl.store(PM + ((b.to(tl.int64) * NUM_HEADS + heads) * (NUM_PARTS * SLICES) + z), best, mask=rows < GROUP)


@triton.jit
def _wait_for(counter, target):
    """Spin until *counter >= target (acquire at GPU scope), then let the whole program read what the
    counting programs wrote before their release."""
    seen = tl.atomic_add(counter, 0, sem="acquire")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire")
    tl.debug_barrier()


# ----- decode 1, the other programs: 2-bit scan -> keep flags ---------------------------------

@triton.jit
def _load_qt_plane(Q, b, hk, stride_qb, stride_qh, j: tl.constexpr, GROUP: tl.constexpr, SCAN_N: tl.constexpr,
                   D4: tl.constexpr):
    """Channel plane j of the q rows of KV head hk, transposed and in fp32: [D/4, SCAN_N] (columns
    >= GROUP are 0)."""
    cols = tl.arange(0, SCAN_N)
    return tl.load(Q + b.to(tl.int64) * stride_qb + (hk * GROUP + cols)[None, :] * stride_qh + j * D4
                   + tl.arange(0, D4)[:, None], mask=(cols < GROUP)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _scan_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP: tl.constexpr, SCAN_N: tl.constexpr, D4: tl.constexpr,
                 UPCAST: tl.constexpr):
    """The scan's q side of KV head hk: four transposed planes [D/4, SCAN_N] and q_unit [SCAN_N].
    GPU: each row divided by q_unit = max |q row| / 127, so |q / q_unit| <= 127 (the int8 range of
    `_scan_block_max`); interpreter: q itself and q_unit = 1."""
    qa0 = _load_qt_plane(Q, b, hk, stride_qb, stride_qh, 0, GROUP, SCAN_N, D4)
    qa1 = _load_qt_plane(Q, b, hk, stride_qb, stride_qh, 1, GROUP, SCAN_N, D4)
    qa2 = _load_qt_plane(Q, b, hk, stride_qb, stride_qh, 2, GROUP, SCAN_N, D4)
    qa3 = _load_qt_plane(Q, b, hk, stride_qb, stride_qh, 3, GROUP, SCAN_N, D4)
    q_unit = tl.full([SCAN_N], 1.0, tl.float32)
    if not UPCAST:
        q_unit = tl.maximum(tl.maximum(tl.max(tl.abs(qa0), 0), tl.max(tl.abs(qa1), 0)),
                            tl.maximum(tl.max(tl.abs(qa2), 0), tl.max(tl.abs(qa3), 0))) / INT8_Q_MAX
        inv = 1.0 / tl.maximum(q_unit, 1e-30)          # zero rows (padding) stay zero
        qa0, qa1, qa2, qa3 = qa0 * inv[None, :], qa1 * inv[None, :], qa2 * inv[None, :], qa3 * inv[None, :]
    return qa0, qa1, qa2, qa3, q_unit


@triton.jit
def _scan_plane(byte, j: tl.constexpr):
    """Code plane j of a uint8 code tile as int8 lanes 0..3 (`scan_plane_asm`; GPU only)."""
    return _plane_of(byte, j, SCAN_ASM_0, SCAN_ASM_1, SCAN_ASM_2, SCAN_ASM_3, True)


@triton.jit
def _int8_q_side(qt, sn):
    """round(qt * sn) [BPP, D/4, SCAN_N] (|qt * sn| <= 127) as int8 and as int32: one fma adds
    INT_ROUND, the rounded value is the low bits (no conversion instruction)."""
    v = (qt[None, :, :] * sn[:, :, None] + INT_ROUND).to(tl.int32, bitcast=True) - INT_ROUND_BITS
    return v.to(tl.int8), v


@triton.jit
def _scan_step_loads(CODES, SCALES, bt_row, blks, ok, hk, NUM_KV_HEADS: tl.constexpr, BS: tl.constexpr,
                     D: tl.constexpr, D4: tl.constexpr):
    """Every load of one scan step, issued before any math: the page ids of the BPP blocks `blks`
    (0 where not ok), then their four channel-range scales [BPP, D/4] and codes [BPP, BS, D/4]
    (returned)."""
    pages = tl.load(bt_row + blks, mask=ok, other=0).to(tl.int64)
    qbase = pages * NUM_KV_HEADS + hk                                          # [BPP]
    cols = tl.arange(0, D4)
    sptr = SCALES + qbase[:, None] * D + cols[None, :]                         # [BPP, D4]
    s0 = tl.load(sptr + 0 * D4, mask=ok[:, None], other=0.0)
    s1 = tl.load(sptr + 1 * D4, mask=ok[:, None], other=0.0)
    s2 = tl.load(sptr + 2 * D4, mask=ok[:, None], other=0.0)
    s3 = tl.load(sptr + 3 * D4, mask=ok[:, None], other=0.0)
    toks = tl.arange(0, BS)
    byte = tl.load(CODES + (qbase[:, None, None] * BS + toks[None, :, None]) * D4 + cols[None, None, :],
                   mask=ok[:, None, None], other=0)                            # [BPP, BS, D4]
    return s0, s1, s2, s3, byte


@triton.jit
def _scan_block_max(qt0, qt1, qt2, qt3, q_unit, CODES, SCALES, bt_row, blks, ok, hk, scale_log2, BPP: tl.constexpr,
                    NUM_KV_HEADS: tl.constexpr, SCAN_N: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                    D4: tl.constexpr, UPCAST: tl.constexpr, SUM_BY_MMA: tl.constexpr):
    """Each row's 2-bit block max (log2 units) [BPP, SCAN_N] of the BPP blocks `blks`.

    q.(2-bit key) as in `_quant_scores(..., REFINE=False)`, batched over the blocks (3-D dots) and
    transposed: [BS, D/4] x [D/4, SCAN_N] per plane, so the MMA pads the G query rows to 8, not 16,
    and the codes are the A operand, which the compiler expands in registers. The max over tokens is
    taken before the (monotone) scaling: same result, 1/BS of the work.

    GPU: int8 MMA (m16n8k32: four codes per register, one K-step per plane). The codes are int8
    lanes 0..3 (`scan_plane_asm`); the q side is round(q' s / s_max), q' = q / q_unit
    (`_scan_rows_q`) and s_max the block's largest channel scale, so it is within [-127, 127]. The
    int32 dot minus 1.5 * the sum of the rounded q side is exactly the level dot of the rounded q
    side, scaled back by q_unit * s_max. SUM_BY_MMA: that sum is an int8 MMA of an all-ones operand
    with the q side (every one of its 16 rows is the sum, exact), 4 more IMMA instead of the q side
    recomputed in a second register layout and reduced over the channels (fewer instructions per step;
    `scan_sum_by_mma` says where it is faster). Interpreter: the exact levels in fp32 (q_unit = 1)."""
    s0, s1, s2, s3, byte = _scan_step_loads(CODES, SCALES, bt_row, blks, ok, hk, NUM_KV_HEADS, BS, D, D4)
    if UPCAST:
        raw = tl.zeros([BPP, BS, SCAN_N], tl.float32)                         # q.k over [BPP, tokens, rows]
        raw = tl.dot(_code_plane(byte, 0, UPCAST), qt0[None, :, :] * s0[:, :, None], raw, input_precision="ieee")
        raw = tl.dot(_code_plane(byte, 1, UPCAST), qt1[None, :, :] * s1[:, :, None], raw, input_precision="ieee")
        raw = tl.dot(_code_plane(byte, 2, UPCAST), qt2[None, :, :] * s2[:, :, None], raw, input_precision="ieee")
        raw = tl.dot(_code_plane(byte, 3, UPCAST), qt3[None, :, :] * s3[:, :, None], raw, input_precision="ieee")
        return tl.max(raw, 1) * scale_log2
    s_max = tl.max(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)), 1)      # [BPP]; masked blocks: s = 0
    # 1 / s_max to 1 ulp (one MUFU.RCP, not IEEE division): |q side| <= 127 (1 + 2^-23) still rounds to 127
    inv = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [tl.maximum(s_max, 1e-30)],
                                    dtype=tl.float32, is_pure=True, pack=1)
    i0, v0 = _int8_q_side(qt0, s0 * inv[:, None])
    i1, v1 = _int8_q_side(qt1, s1 * inv[:, None])
    i2, v2 = _int8_q_side(qt2, s2 * inv[:, None])
    i3, v3 = _int8_q_side(qt3, s3 * inv[:, None])
    if SUM_BY_MMA:   # four independent dots: no chain in front of the block max
        ones = tl.full([BPP, 16, D4], 1, tl.int8)
        zero = tl.zeros([BPP, 16, SCAN_N], tl.int32)
        q_sum = tl.max(tl.dot(ones, i0, zero, out_dtype=tl.int32) + tl.dot(ones, i1, zero, out_dtype=tl.int32)
                       + tl.dot(ones, i2, zero, out_dtype=tl.int32) + tl.dot(ones, i3, zero, out_dtype=tl.int32), 1)
    else:
        q_sum = tl.sum(v0 + v1 + v2 + v3, 1)
    acc = tl.zeros([BPP, BS, SCAN_N], tl.int32)
    acc = tl.dot(_scan_plane(byte, 0), i0, acc, out_dtype=tl.int32)
    acc = tl.dot(_scan_plane(byte, 1), i1, acc, out_dtype=tl.int32)
    acc = tl.dot(_scan_plane(byte, 2), i2, acc, out_dtype=tl.int32)
    acc = tl.dot(_scan_plane(byte, 3), i3, acc, out_dtype=tl.int32)
    twice = 2 * tl.max(acc, 1) - 3 * q_sum                                     # 2 (dot - 1.5 sum): exact
    return twice.to(tl.float32) * (0.5 * s_max)[:, None] * q_unit[None, :] * scale_log2


@triton.jit
def _scan_block_max_rows(q0, q1, q2, q3, CODES, SCALES, bt_row, blks, ok, hk, scale_log2, BPP: tl.constexpr,
                         NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                         D4: tl.constexpr, UPCAST: tl.constexpr):
    """`_scan_block_max` with the query rows as the dots' M (padded to 16) and the exact levels: for
    head_dim 64, where a plane is only 16 channels deep and the transposed form's codes would go
    through shared memory as bf16 (twice the instructions, measured)."""
    s0, s1, s2, s3, byte = _scan_step_loads(CODES, SCALES, bt_row, blks, ok, hk, NUM_KV_HEADS, BS, D, D4)
    raw = tl.zeros([BPP, BLOCK_H, BS], tl.float32)                            # q.k over [BPP, rows, tokens]
    raw = _plane_term(raw, q0.to(tl.float32)[None, :, :] * s0[:, None, :],
                      tl.permute(_code_plane(byte, 0, UPCAST), (0, 2, 1)), False, UPCAST)
    raw = _plane_term(raw, q1.to(tl.float32)[None, :, :] * s1[:, None, :],
                      tl.permute(_code_plane(byte, 1, UPCAST), (0, 2, 1)), False, UPCAST)
    raw = _plane_term(raw, q2.to(tl.float32)[None, :, :] * s2[:, None, :],
                      tl.permute(_code_plane(byte, 2, UPCAST), (0, 2, 1)), False, UPCAST)
    raw = _plane_term(raw, q3.to(tl.float32)[None, :, :] * s3[:, None, :],
                      tl.permute(_code_plane(byte, 3, UPCAST), (0, 2, 1)), False, UPCAST)
    return tl.max(raw, 2) * scale_log2


@triton.jit
def _keep_decisions(bmax_row, th, bt_row, flag_row, mask_row, prog, programs, steps, nq, sink_blocks, forced_hi,
                    BPP: tl.constexpr, SCAN_N: tl.constexpr, BS: tl.constexpr, CHUNK: tl.constexpr,
                    WRITE_MASK: tl.constexpr):
    """Keep decisions of a scan program's blocks (steps prog, prog + programs, ...) from their stored
    block maxes, CHUNK steps per vector: the flag is the page id of a kept block, -1 of a dropped one
    (so the attend pass reads no block table). Returns the kept count."""
    k = tl.arange(0, CHUNK * BPP)                       # (step, block of the step), flattened
    cols = tl.arange(0, SCAN_N)
    n_kept = nq * 0
    for c in range(0, tl.cdiv(steps - prog, programs), CHUNK):
        step = prog + (c + k // BPP) * programs
        blks = step * BPP + k % BPP
        ok = (step < steps) & (blks < nq)
        bmax = tl.load(bmax_row + blks[:, None] * SCAN_N + cols[None, :], mask=ok[:, None], other=float("-inf"))
        hit = tl.max(tl.where(bmax >= th[None, :], 1, 0), 1)
        keep = (hit > 0) | (blks < sink_blocks) | ((blks + 1) * BS > forced_hi)
        pages = tl.load(bt_row + blks, mask=ok, other=0)
        tl.store(flag_row + blks, tl.where(keep, pages, -1).to(tl.int32), mask=ok)
        n_kept += tl.sum((keep & ok).to(tl.int32), 0)
        if WRITE_MASK:   # test output: the keep decision of every full block
            tl.store(mask_row + blks, keep.to(tl.int8), mask=ok)
    return n_kept


@triton.jit
def _scan_kernel(Q, K, V, KMAP, CODES, SCALES, RES, BT, SEQ, PM, BMAX, FLAGS, MASK, SYNC,
                 stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt, stride_mask, max_blocks,
                 scale_log2, delta_log2, sink, window, min_ffd_len,
                 BPP: tl.constexpr, SINK_PARTS: tl.constexpr, NUM_PARTS: tl.constexpr, PARTS_PAD: tl.constexpr,
                 NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
                 D: tl.constexpr, D4: tl.constexpr, BS: tl.constexpr, UPCAST: tl.constexpr, HAS_KMAP: tl.constexpr,
                 WRITE_MASK: tl.constexpr, SCAN_N: tl.constexpr, TOKENS_AS_M: tl.constexpr, SUM_BY_MMA: tl.constexpr,
                 PM_SLICE: tl.constexpr, DECIDE_CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Threshold and keep decisions of (sequence, KV head) in one launch. Programs z < PM_PROGRAMS
    (NUM_PARTS * BS / PM_SLICE) are the pseudo-max slices (`_pseudo_max_part`); each then counts
    itself in the row's READY counter. Scan program p = z - PM_PROGRAMS takes the BPP-block steps
    p, p + P, ... (P scan programs per row) and stores each block's per-row 2-bit max in BMAX, which
    needs no threshold; only then does it wait for READY = PM_PROGRAMS (the slices are the grid's
    lowest program ids, so they are dispatched first, and their few tokens take far less time than a
    scan program's loop), take th = max over the slices - δ and turn its stored maxes into keep
    flags. SYNC (int32, zero between calls): [kept-block total, READY per row]; the merge zeroes
    both (it runs after this launch has finished). The kept-block count is a relaxed atomic: only
    later launches read it, so a fence per program would buy nothing but warp time."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    z = tl.program_id(2)
    PM_PROGRAMS: tl.constexpr = NUM_PARTS * (BS // PM_SLICE)
    _release_next(PDL)
    L = tl.load(SEQ + b)
    if L < min_ffd_len:     # "auto", a dense row: the attend reads nothing of this launch for it
        return
    row = b.to(tl.int64) * NUM_KV_HEADS + hk
    ready = SYNC + 1 + row
    if z < PM_PROGRAMS:
        _pseudo_max_part(Q, K, V, KMAP, CODES, SCALES, RES, BT, PM, b, hk, z, L,
                         stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_bt,
                         scale_log2, sink, window, SINK_PARTS, NUM_PARTS, NUM_HEADS, NUM_KV_HEADS,
                         GROUP, BLOCK_H, D, D4, BS, PM_SLICE, UPCAST, HAS_KMAP)
        tl.debug_barrier()                      # every thread's PM store before the release
        tl.atomic_add(ready, 1, sem="release")
    else:
        prog = z - PM_PROGRAMS
        programs = tl.num_programs(2) - PM_PROGRAMS
        nq = L // BS                              # full blocks (dense rows returned above)
        steps = tl.cdiv(nq, BPP)
        cols = tl.arange(0, SCAN_N)
        bt_row = BT + b.to(tl.int64) * stride_bt
        bmax_row = BMAX + row * max_blocks * SCAN_N
        if prog < steps:
            if TOKENS_AS_M:
                qa0, qa1, qa2, qa3, q_unit = _scan_rows_q(Q, b, hk, stride_qb, stride_qh, GROUP, SCAN_N, D4, UPCAST)
            else:
                qa0, qa1, qa2, qa3 = _load_q_planes(Q, b, hk, stride_qb, stride_qh, GROUP, SCAN_N, D4, UPCAST)
            for step in range(prog, steps, programs):
                blks = step * BPP + tl.arange(0, BPP)
                ok = blks < nq
                if TOKENS_AS_M:
                    bmax = _scan_block_max(qa0, qa1, qa2, qa3, q_unit, CODES, SCALES, bt_row, blks, ok, hk, scale_log2,
                                           BPP, NUM_KV_HEADS, SCAN_N, BS, D, D4, UPCAST, SUM_BY_MMA)
                else:
                    bmax = _scan_block_max_rows(qa0, qa1, qa2, qa3, CODES, SCALES, bt_row, blks, ok, hk,
                                                scale_log2, BPP, NUM_KV_HEADS, SCAN_N, BS, D, D4, UPCAST)
                tl.store(bmax_row + blks[:, None] * SCAN_N + cols[None, :], bmax, mask=ok[:, None])
        _wait_for(ready, PM_PROGRAMS)             # also orders this program's BMAX stores before the reads
        if prog < steps:
            heads = hk * GROUP + cols
            parts = tl.arange(0, PARTS_PAD)
            pm = tl.load(PM + (b.to(tl.int64) * NUM_HEADS + heads)[:, None] * PM_PROGRAMS + parts[None, :],
                         mask=(cols < GROUP)[:, None] & (parts < PM_PROGRAMS)[None, :], other=float("-inf"),
                         cache_modifier=".cg")
            th = tl.where(cols < GROUP, tl.max(pm, 1) - delta_log2, float("inf"))    # padding rows keep nothing
            sink_blocks = tl.minimum(tl.cdiv(sink, BS), nq)
            forced_hi = tl.maximum(L - window, 0)                                # blocks ending after this: window
            n_kept = _keep_decisions(bmax_row, th, bt_row, FLAGS + row * max_blocks, MASK + row * stride_mask,
                                     prog, programs, steps, nq, sink_blocks, forced_hi, BPP, SCAN_N, BS,
                                     DECIDE_CHUNK, WRITE_MASK)
            tl.atomic_add(SYNC, n_kept, sem="relaxed")
