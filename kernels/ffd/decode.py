"""Faster Flash Decoding in Triton: the decode (threshold, 2-bit scan, refine + accumulate over the
kept blocks, exact tail) with a split-KV log-sum-exp merge; quantize-on-write is
`kernels/ffd/quantize.py`. The rule and the key format are those of `kernels/ffd/reference.py` (its
docstring is the specification); these files only make it fast: the launches here, the scan in
`kernels/ffd/scan.py`, the attend and the merge in `kernels/ffd/attend.py`, their shared device
pieces in `kernels/ffd/tiles.py` and the PTX operand builders in `kernels/ffd/ptx.py`.

Decode, three launches, all with grids fixed by the batch and the tensor shapes and the lengths read
on the device (graph-safe, no host sync, no data-sized allocation, deterministic):
  1. `_scan_kernel` (sequence, KV head, program) does the threshold and the 2-bit scan in one launch.
     Its lowest program ids are the pseudo-max (`_pseudo_max_part`): each takes 32 tokens of one
     sink block, one window block or the exact tail and writes its row max over the sink /
     local-window tokens (refined keys in full blocks, exact keys in the tail); the threshold is
     th = max over them - δ (log2 units). The other programs are a pure stream over the 2-bit codes
     (36 B per token and head at D = 128). Each step takes BPP full blocks at once (page ids as one
     vector, then all their codes and scales, then batched 3-D dots) and nothing in the loop
     branches on data, so Triton pipelines it. A block's scores are four [BS x D/4] x [D/4 x G]
     dots, one per code plane (`(byte >> 2j) & 3` is channel range j, no shuffles): the tokens are
     the MMA's M and the G query heads of the KV head its N, which the MMA pads to 8 (as rows, to
     16: twice the tensor-core work). The loop stores each block's per-row max, which needs no
     threshold; only after it does a program wait for its row's pseudo-max programs (a counter:
     they are dispatched first and their few tokens take far less time than the loop, so the wait
     is normally over before it starts) and turn the stored maxes into keep decisions: a block is
     kept when any row's block max reaches its threshold, or it overlaps the sinks or the window.
     It stores the kept block's page id (-1 if dropped), so the next pass reads no block table,
     and adds its kept blocks to the batch's counter (one atomic per program). One launch instead
     of two takes the pseudo-max's ~5 us chain off the critical path (H200, B = 1, 128K: 54.0 ->
     46.8 us). Where the grid is under one wave (B = 1) and its programs long, it is one full wave of
     the MMA-sum form instead (`SCAN_WAVE_MIN_STEPS`): more, shorter programs.
  2. `_attend_kernel` (sequence, KV head, split): only the kept blocks. Each split counts them,
     takes those of ranks [split * per, (split + 1) * per) (ranks by a prefix sum, so the work is
     balanced whatever the sparsity pattern), where per also spreads the batch's kept blocks over
     about the programs the GPU holds at once (one round, not several rounds of short programs that
     each pay the fixed chain of flags, ranks and q), gathers their page ids into its slot row once, then
     loops over them with no data-dependent branch: refined scores, V, online softmax in base 2,
     all loads of a block issued before its math. The last split, the one most often idle, also
     attends the exact tail (the tokens past the last full block).
  3. `_merge_kernel` (sequence, query head, channel chunk): log-sum-exp merge of all splits; an
     empty split wrote m = -inf and weighs 0.
On sm_90+ the attend and the merge are launched as programmatic dependents: they start (q loads)
while the previous launch ends and wait for its results (`griddepcontrol.wait`), about 2 us per
decode at B = 1. The scan, the first launch, is not (when the pseudo-max was a launch of its own,
a scan launched early beside it lost 4-10 us at B = 1, 128K-256K). The launches' counters live in a
small int32 buffer that every call leaves zero (`ffd_sync_buffer`).
Scan and attend are separate passes because a fused loop branches on every block's decision and
chains several memory round trips per block, which neither pipelining nor the few resident
programs can hide. "auto": a sequence shorter than `min_ffd_len` is skipped by the scan and the
attend grid runs dense split-KV over its exact keys (Flash-Decoding), per sequence, so mixed
batches need no host decision.

Arithmetic: the conversion unit (16 results per clock and SM) is the scarce resource of both
passes, so the GPU builds MMA operands from bits with a few integer instructions (`plane_asm`,
`scan_plane_asm`, `residual_asm`, `refined_plane_asm`): the code planes as their exact levels
code - 1.5 in bf16 (threshold), or as the int8 codes 0..3 themselves for the scan's int8 MMA (two
integer instructions per four codes, one K-step per plane, 1.5 * sum(q side) taken out after the
dot; H200, B = 8, 128K: 225.2 -> 206.0 us per decode against the bf16 form's 128 + f * code), the
e4m3 residual as exact bf16 times a power of two that the q side compensates (threshold) or, with
one bf16 fma per two values, added to the level (the attend's refined key).
Precision: the 2-bit scan (selection only) dots the exact levels with q*scale rounded to int8 steps
of u = max|q row| * max(block's channel scales) / 127, i.e. an error of at most u / 2 per channel
(254 steps across the largest |q s| the block can hold; bf16 keeps 2^-9 of each |q s|). The
pseudo-max, which sets the threshold, scores with q*scale split into bf16 hi + lo parts plus
q.residual with q*scale/R rounded to bf16 (~fp32-accurate, so selection matches the torch rule). A
kept block's softmax scores are bf16(q*scale) . bf16(code - 1.5 + r/R) per plane: the refined key
rounded to bf16 (at most 2^-8 of the channel scale, a quarter of the stored e4m3 residual's own
rounding; the precision of a bf16 KV cache) and one dot per plane instead of three (H200, B = 8,
128K: attend 123.4 -> 104.4 us). P.V runs in V's dtype, fp32 accumulate. Under the interpreter
(UPCAST) all of it is fp32 arithmetic.
"""
from __future__ import annotations

import math

import torch
import triton

from kernels.ffd.attend import _attend_kernel, _merge_kernel
from kernels.ffd.reference import FFDParams
from kernels.ffd.scan import _scan_kernel
from kernels.attention.flash_decoding import rows_per_tile
from kernels.occupancy import resident_ctas
from kernels.vendor import interpreting, num_compute_units, programmatic_launch

LOG2E = 1.4426950408889634


SCAN_PROGRAMS_PER_SM = 8     # scan grid size (choose_splits): H200 sweeps in bench/RESULTS.md
ATTEND_PROGRAMS_PER_SM = 8   # attend grid size
# Fewest kept blocks an attend split takes, and fewest pages for "auto"'s dense rows. H200, 1 against 2
# (results/ffd_min_per_split.json): kept blocks B = 1, 16K 24.4 against 26.8 us, the same elsewhere (long
# rows get several per split from the resident term); dense rows B = 1 21.8 against 20.9 (4K), 33.6
# against 32.3 (16K), B = 8 the same.
MIN_PER_SPLIT = 1
DENSE_MIN_PER_SPLIT = 2
# Scan step shape, H200 sweeps (bench/RESULTS.md): one block per step on one warp, 4 programs per SM and a
# 6-deep pipeline beat 2 blocks on 2 warps with 2 programs per SM (B = 8, 128K: 262.4 vs 269.8 us; B = 1,
# 256K: 84.9 vs 86.0) and 4 blocks on 4 warps; more warps per block (4 warps, 2 blocks: 402.5) lose.
# 8 programs per SM then: B = 8, 128K 253.4 vs 262.6 (16: 250.8, but 16K slower), B = 1 the same.
SCAN_BLOCKS_PER_STEP = 1   # BPP: [BPP, BS, D/4] codes and [BPP, BS, G] scores in registers
SCAN_WARPS = 1
SCAN_STAGES = 6         # H200: 6 beat 3, 4, 8 and 10 (B = 1, 256K: 100.0 vs 105.9 us; B = 8, 128K: 278.6 vs 300.4)
# The scan's transposed dots (tokens as M) from this head_dim up: at D = 64 a code plane is 16 channels, too
# shallow for the compiler to expand the codes in registers (sm_90 SASS: 1561 against 796 instructions per step).
SCAN_TOKENS_AS_M_MIN_DIM = 128
# The scan's sum of its int8 q side by an MMA (`_scan_block_max`) where its grid is more than the
# SCAN_PROGRAMS_PER_SM programs per SM that run at once, i.e. where the scan is bound by instruction
# throughput; where it is one wave each program's step latency matters more. H200, side by side
# (results/ffd_scan_sum_forms.json, run 2): B = 8, 128K, f = 0.02 130.6 -> 125.7 us, 64K 116.4 -> 111.8; B = 1,
# 128K 44.3 against 44.5, 256K 67.5 against 71.0; and in the one-wave grid (SCAN_WAVE_MIN_STEPS). None: by those
# rules; True / False: always / never (False also keeps the default grid).
SCAN_SUM_BY_MMA: bool | None = None
# A scan grid under one wave of the MMA-sum form (head_dim >= SCAN_TOKENS_AS_M_MIN_DIM; B = 1 at Llama-3.1-8B
# shapes) becomes one full wave of it (12 programs per SM at 164 registers: 182 scan programs per row instead of
# 128) where its programs would take at least this many block steps. H200, side by side
# (results/ffd_scan_one_wave.json), B = 1: 128K 44.6 -> 42.6 us, 256K 67.6 -> 64.9; at 64K (4 steps -> 3) 34.0
# against 34.1, no gain, hence the floor.
SCAN_WAVE_MIN_STEPS = 8
FLAG_CHUNK = 4096       # flags per prefix-sum step of the attend kernel: one step up to 512K tokens at BS 128
PM_SLICE = 32           # tokens per pseudo-max program: [16, 32] tiles fit the scan's one warp unspilled
DECIDE_CHUNK = 64       # scan steps whose keep decisions one vector takes (B = 1, 256K: 16 per program)
MERGE_TILE = 4096       # fp32 partial elements one merge program holds: [splits, channels]


def choose_splits(batch: int, num_kv_heads: int, device: torch.device, per_sm: int = 8) -> int:
    """About `per_sm` programs per SM at this batch size, a power of two <= 128 (B only: graph-safe).

    The attend grid uses ATTEND_PROGRAMS_PER_SM: several waves of programs (`attend_resident_per_sm`
    fit an SM at once) spread one long sequence of a skewed batch over the whole GPU, and a sequence's attend
    splits get at least MIN_PER_SPLIT kept blocks each, the rest exit at once. The scan grid uses
    SCAN_PROGRAMS_PER_SM (or one full wave, SCAN_WAVE_MIN_STEPS): its programs walk their blocks in a
    grid-stride loop, so any count covers every block."""
    target = per_sm * num_compute_units(device)
    return min(128, triton.next_power_of_2(max(1, math.ceil(target / max(1, batch * num_kv_heads)))))


def scan_sum_by_mma(scan_programs: int, compute_units: int) -> bool:
    """Whether the scan sums its int8 q side by an MMA (SCAN_SUM_BY_MMA)."""
    if SCAN_SUM_BY_MMA is not None:
        return SCAN_SUM_BY_MMA
    return scan_programs > SCAN_PROGRAMS_PER_SM * compute_units


def attend_slots(max_blocks: int, splits: int, min_per: int) -> int:
    """PER_MAX, the page-id slots of one attend split: a power of two >= max(ceil(max_blocks /
    splits), min_per).

    Why no kept block is ever dropped: a sequence has kept <= nq <= max_blocks kept blocks, and
    each split takes per = max(ceil(kept / splits), min_per, min(balance, PER_MAX)) of them (balance:
    the batch's share per resident program, any value), so
      per <= max(ceil(max_blocks / splits), min_per, PER_MAX) = PER_MAX  (every split fits its slots),
      splits * per >= kept                                               (the ranges cover all ranks);
    the ranges [s * per, (s + 1) * per) are disjoint, so each kept block is attended exactly once.
    """
    return triton.next_power_of_2(max(1, -(-max_blocks // splits), min_per))


def attend_stages(block_size: int, head_dim: int) -> int:
    """Pipeline depth of the attend loop: 3 where two programs still share an SM's 228 KB of shared
    memory (BS * D <= 128 * 128: 113 KB each on sm_90), else 2. H200, B = 8, 128K: 265.0 against
    274.0 us; B = 1, 256K: 86.9 against 89.3."""
    return 3 if block_size * head_dim <= 128 * 128 else 2


def attend_resident_per_sm(args: tuple, kwargs: dict, q: torch.Tensor, k_cache: torch.Tensor) -> int:
    """Attend programs one SM runs at once, from the compiled kernel's registers and shared memory
    (`kernels.occupancy`, once per specialisation). Compiled for sm_90: 2 at the default pages (255
    registers, 113 KB of shared memory), 3 at head_dim 64, 1 at 256-token pages. 2 in the
    interpreter, which has no SMs."""
    if q.device.type != "cuda":
        return 2
    key = ("ffd_attend", q.dtype, k_cache.dtype, tuple(kwargs.items()))   # built in a fixed order
    return resident_ctas(_attend_kernel, key, (*args, 0), kwargs, q.device)


def sync_entries(batch: int, kv_heads: int) -> int:
    """int32 counters one decode launch uses: the kept-block total, then READY per (sequence, KV head)."""
    return 1 + batch * kv_heads


def ffd_sync_buffer(batch: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """Zeroed counters for `ffd_decode` calls of up to `batch` sequences: each call leaves them zero, so
    a caller that keeps one per stream pays no memset per call (calls on other streams need their own)."""
    return torch.zeros(sync_entries(batch, kv_heads), dtype=torch.int32, device=device)


def check_ffd_inputs(what: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, params: FFDParams) -> None:
    """Raise for shapes and layouts the FFD kernels do not serve (q [T, Hq, D], pages [N, BS, Hkv, D])."""
    num_heads, dim = q.shape[1:]
    _, bs, kv_heads, _ = k_cache.shape
    if bs != params.block_size:
        raise ValueError(f"KV page size {bs} != ffd block size {params.block_size}")
    if dim not in (64, 128, 256) or k_cache.shape[3] != dim:
        raise ValueError(f"FFD's Triton kernels serve head_dim 64, 128 or 256 (D/4 >= 16 for tl.dot); got {dim}")
    if num_heads % kv_heads or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError(f"{what}: Hq must be a multiple of Hkv, K/V pages must share strides, "
                         "and head dims must be contiguous")
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables and seq_lens must be int32, block_tables rows contiguous")


def ffd_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, codes: torch.Tensor,
               scales: torch.Tensor, residual: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               *, scale: float, params: FFDParams, num_splits: int | None = None,
               stats: torch.Tensor | None = None, out: torch.Tensor | None = None,
               masks: torch.Tensor | None = None, key_page_map: torch.Tensor | None = None,
               resident_programs: int | None = None, pdl: bool | None = None,
               sync: torch.Tensor | None = None) -> torch.Tensor:
    """q[B, Hq, D] -> out[B, Hq, D] under the FFD rule (decode: one query per sequence).

    k/v_cache [N, BS, Hkv, D] exact pages; codes/scales/residual the same pages quantized
    (`kernels.ffd.reference`). With `key_page_map` (int32 [N]) k_cache is a smaller pool and the
    exact keys of page p are its page key_page_map[p] (only the tails are read). `stats` (int64 [2],
    optional) += (full blocks, kept blocks) over (sequence, KV head) pairs; `masks` (int8 [B, Hkv, >= max blocks], optional, for tests) gets
    1/0 for every full block the kernel visited. `num_splits` is rounded up to a power of two.
    `resident_programs`: the attend programs to spread the batch's kept blocks over (default: those
    the GPU runs at once minus one per (sequence, KV head), whose ceil() may each add one; 0, and
    the default with `num_splits`: only the per-sequence rule). `pdl`: the attend and the merge start
    while the previous launch ends (programmatic dependent launch; default: where the GPU has it,
    False: plain stream order). `sync`: the launches' int32 counters (`ffd_sync_buffer`), zero between calls and
    left zero by each, so one buffer serves every call on a stream (default: a zeroed one per call).
    Raises for shapes the kernel does not serve, for `pdl=True` where the GPU has no such launch, and
    for a `sync` buffer too small for the batch.
    """
    batch, num_heads, dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    check_ffd_inputs("FFD decode", q, k_cache, v_cache, block_tables, seq_lens, params)
    out = torch.empty_like(q) if out is None else out
    if batch == 0:
        return out
    group = num_heads // kv_heads
    dev = q.device
    units = num_compute_units(dev)
    launchable = programmatic_launch(dev)
    if pdl and not launchable:
        raise ValueError(f"pdl=True: programmatic dependent launch needs an NVIDIA sm_90+ GPU; q is on {dev}")
    pdl = launchable if pdl is None else pdl
    dependent = {"launch_pdl": True} if pdl else {}     # launch options of the attend and the merge
    if sync is None:
        sync = ffd_sync_buffer(batch, kv_heads, dev)
    elif sync.dtype != torch.int32 or sync.device != dev or sync.numel() < sync_entries(batch, kv_heads):
        raise ValueError(f"sync must be int32 on {dev} with >= {sync_entries(batch, kv_heads)} entries "
                         f"(ffd_sync_buffer); got {sync.dtype} [{sync.numel()}] on {sync.device}")
    splits = triton.next_power_of_2(int(num_splits or choose_splits(batch, kv_heads, q.device, ATTEND_PROGRAMS_PER_SM)))
    min_per, dense_min_per = (1, 1) if num_splits else (MIN_PER_SPLIT, DENSE_MIN_PER_SPLIT)
    max_blocks = max(1, block_tables.shape[1])
    per_max = attend_slots(max_blocks, splits, min_per)
    flag_chunk = min(FLAG_CHUNK, triton.next_power_of_2(max_blocks))
    sink_parts = -(-params.sink_tokens // bs)
    num_parts = sink_parts + (-(-params.local_window // bs) + 1) + 1
    pm_slice = min(PM_SLICE, bs)
    pm_programs = num_parts * (bs // pm_slice)
    pm = torch.empty(batch * num_heads * pm_programs, dtype=torch.float32, device=dev)
    flags = torch.empty(batch * kv_heads * max_blocks, dtype=torch.int32, device=dev)   # page id or -1
    slots = torch.empty(batch * kv_heads * splits * per_max, dtype=torch.int32, device=dev)
    p_acc = torch.empty(batch * num_heads * splits * dim, dtype=torch.float32, device=dev)
    p_ml = torch.empty(batch * num_heads * splits * 2, dtype=torch.float32, device=dev)
    block_h = rows_per_tile(group)
    delta = params.delta_log2 if math.isfinite(params.delta_log2) else 1e30
    common = {"NUM_HEADS": num_heads, "NUM_KV_HEADS": kv_heads, "GROUP": group, "BLOCK_H": block_h, "D": dim,
              "D4": dim // 4, "BS": bs, "UPCAST": interpreting()}
    kmap = seq_lens if key_page_map is None else key_page_map      # any int32 tensor when unused
    q_strides = (q.stride(0), q.stride(1))
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    tokens_as_m = dim >= SCAN_TOKENS_AS_M_MIN_DIM
    scan_n = triton.next_power_of_2(group) if tokens_as_m else block_h
    bmax = torch.empty(batch * kv_heads * max_blocks * scan_n, dtype=torch.float32, device=dev)
    # the pseudo-max parts first: the lowest program ids, dispatched before the scan programs that wait on them
    scan_args = (q, k_cache, v_cache, kmap, codes, scales, residual, block_tables, seq_lens, pm, bmax, flags,
                 masks if masks is not None else flags, sync, *q_strides, *kv_strides, block_tables.stride(0),
                 masks.shape[2] if masks is not None else 0, max_blocks,
                 scale * LOG2E, delta, params.sink_tokens, params.local_window, params.min_ffd_len)
    scan_consts = dict(BPP=SCAN_BLOCKS_PER_STEP, SINK_PARTS=sink_parts, NUM_PARTS=num_parts,
                       PARTS_PAD=triton.next_power_of_2(pm_programs), HAS_KMAP=key_page_map is not None,
                       WRITE_MASK=masks is not None, SCAN_N=scan_n, TOKENS_AS_M=tokens_as_m, PM_SLICE=pm_slice,
                       DECIDE_CHUNK=DECIDE_CHUNK, PDL=pdl, num_warps=SCAN_WARPS, num_stages=SCAN_STAGES, **common)
    scan_splits = choose_splits(batch, kv_heads, dev, SCAN_PROGRAMS_PER_SM)
    sum_by_mma = scan_sum_by_mma(batch * kv_heads * scan_splits, units)
    if q.device.type == "cuda" and tokens_as_m and SCAN_SUM_BY_MMA is not False \
            and -(-max_blocks // scan_splits) >= SCAN_WAVE_MIN_STEPS:
        # under one wave of the MMA-sum form (B = 1): one full wave of it, so shorter programs
        consts = {**scan_consts, "SUM_BY_MMA": True}
        wave = resident_ctas(_scan_kernel, ("ffd_scan", q.dtype, tuple(consts.items())), scan_args, consts, dev) \
            * units // (batch * kv_heads) - pm_programs
        if wave > scan_splits:
            scan_splits, sum_by_mma = wave, True
    _scan_kernel[(batch, kv_heads, pm_programs + scan_splits)](*scan_args, SUM_BY_MMA=sum_by_mma, **scan_consts)
    attend_args = (q, k_cache, v_cache, kmap, codes, scales, residual, block_tables, seq_lens, flags, slots, p_acc,
                   p_ml, stats if stats is not None else p_ml, sync, *q_strides, *kv_strides,
                   block_tables.stride(0), max_blocks, scale * LOG2E, params.min_ffd_len)
    attend_consts = dict(NUM_SPLITS=splits, MIN_PER_SPLIT=min_per, DENSE_MIN_PER_SPLIT=dense_min_per,
                         PER_MAX=per_max, FLAG_CHUNK=flag_chunk, ONE_CHUNK=flag_chunk >= max_blocks,
                         COUNT=stats is not None, HAS_KMAP=key_page_map is not None, PDL=pdl, **common)
    attend_launch = {"num_warps": 4 if dim <= 128 else 8, "num_stages": attend_stages(bs, dim), **dependent}
    if resident_programs is None and not num_splits:
        resident_programs = attend_resident_per_sm(attend_args, {**attend_consts, **attend_launch}, q, k_cache) \
            * units - batch * kv_heads
    _attend_kernel[(batch, kv_heads, splits)](*attend_args, max(0, int(resident_programs or 0)),
                                              **attend_consts, **attend_launch)
    dc = min(dim, max(16, MERGE_TILE // splits))
    _merge_kernel[(batch, num_heads, dim // dc)](out, p_acc, p_ml, sync, out.stride(0), out.stride(1),
                                                 NUM_SPLITS=splits, NUM_HEADS=num_heads, NUM_KV_HEADS=kv_heads,
                                                 D=dim, DC=dc, PDL=pdl,
                                                 num_warps=4, **dependent)
    return out
