"""Faster Flash Decoding in Triton: the decode (threshold, 2-bit scan, refine + accumulate over the
kept blocks, exact tail) with a split-KV log-sum-exp merge, as plan + run; quantize-on-write is
`kernels/ffd/quantize.py`. The rule and the key format are those of `kernels/ffd/reference.py` (its
docstring is the specification); these files only make it fast: the launches here, the scan in
`kernels/ffd/scan.py`, the attend and the merge in `kernels/ffd/attend.py`, their shared device
pieces in `kernels/ffd/tiles.py` and the PTX operand builders in `kernels/ffd/ptx.py`.
`plan_ffd_decode` does the host work once per step from shapes (grids, split counts, constexprs,
workspaces), `run_ffd_decode` launches for one layer, `ffd_decode` is both.

Decode, three launches, all with grids fixed by the batch and the tensor shapes and the lengths read
on the device (graph-safe, no host sync, no data-sized allocation, deterministic):
  1. `_scan_kernel` (sequence, KV head, program): the threshold and the 2-bit scan in one launch, so
     the threshold's chain is off the critical path. Its lowest program ids are the pseudo-max
     (`_pseudo_max_part`): each takes 32 tokens of one sink block, one window block or the exact tail
     and writes its row max over the sink / local-window tokens (refined keys in full blocks, exact
     keys in the tail); the threshold is th = max over them - δ (log2 units). The other programs are
     a pure stream over the 2-bit codes (36 B per token and head at D = 128), BPP full blocks per
     step with nothing in the loop branching on data, so Triton pipelines it. A block's scores are
     four [BS x D/4] x [D/4 x G] dots, one per code plane (`(byte >> 2j) & 3` is channel range j, no
     shuffles): the tokens are the MMA's M and the G query heads of the KV head its N, which the MMA
     pads to 8 (as rows, to 16: twice the tensor-core work). The loop stores each block's per-row max,
     which needs no threshold; only then does a program wait for its row's pseudo-max programs (a
     counter; they are dispatched first and take far less time than the loop) and turn the maxes into
     keep decisions: a block is kept when any row's block max reaches its threshold, or it overlaps
     the sinks or the window. It stores the kept block's page id (-1 if dropped), so the next pass
     reads no block table, and adds its kept blocks to the batch's counter (one atomic per program).
     Where the grid is under one wave (B = 1) and its programs long, it is one full wave of the
     MMA-sum form instead (`SCAN_WAVE_MIN_STEPS`): more, shorter programs.
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
while the previous launch ends and wait for its results (`griddepcontrol.wait`). The scan, the
first launch, is not (launched early it lost time). The launches' counters live in a small int32
buffer that every call leaves zero (`ffd_sync_buffer`).
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
dot), the e4m3 residual as exact bf16 times a power of two that the q side compensates (threshold)
or, with one bf16 fma per two values, added to the level (the attend's refined key).
Precision: the 2-bit scan (selection only) dots the exact levels with q*scale rounded to int8 steps
of u = max|q row| * max(block's channel scales) / 127, i.e. an error of at most u / 2 per channel
(254 steps across the largest |q s| the block can hold; bf16 keeps 2^-9 of each |q s|). The
pseudo-max, which sets the threshold, scores with q*scale split into bf16 hi + lo parts plus
q.residual with q*scale/R rounded to bf16 (~fp32-accurate, so selection matches the torch rule). A
kept block's softmax scores are bf16(q*scale) . bf16(code - 1.5 + r/R) per plane: the refined key
rounded to bf16 (at most 2^-8 of the channel scale, a quarter of the stored e4m3 residual's own
rounding; the precision of a bf16 KV cache) and one dot per plane instead of three. P.V runs in
V's dtype, fp32 accumulate. Under the interpreter (UPCAST) all of it is fp32 arithmetic.
Why each tuning constant below has its value (the measurements): bench/RESULTS.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import triton

from kernels.attention.decode_host import contiguous_strides, probe_tensors, rows_per_tile
from kernels.ffd.attend import _attend_kernel, _merge_kernel
from kernels.ffd.reference import FP8, FFDParams
from kernels.ffd.scan import _scan_kernel
from kernels.occupancy import resident_ctas
from kernels.vendor import interpreting, num_compute_units, programmatic_launch

LOG2E = 1.4426950408889634


SCAN_PROGRAMS_PER_SM = 8     # scan grid size (choose_splits): H200 sweeps in bench/RESULTS.md
ATTEND_PROGRAMS_PER_SM = 8   # attend grid size
# Fewest kept blocks an attend split takes, and fewest pages for "auto"'s dense rows: long rows get several
# per split from the resident term anyway, short ones are faster with 1 kept block and 2 dense pages.
MIN_PER_SPLIT = 1
DENSE_MIN_PER_SPLIT = 2
# Scan step shape from the H200 sweeps: one block per step on one warp, a 6-deep pipeline, 8 programs per SM;
# more blocks or more warps per step lose.
SCAN_BLOCKS_PER_STEP = 1   # BPP: [BPP, BS, D/4] codes and [BPP, BS, G] scores in registers
SCAN_WARPS = 1
SCAN_STAGES = 6         # beat 3, 4, 8 and 10 in the H200 sweep
# The scan's transposed dots (tokens as M) from this head_dim up: at D = 64 a code plane is 16 channels, too
# shallow for the compiler to expand the codes in registers (about twice the instructions per step).
SCAN_TOKENS_AS_M_MIN_DIM = 128
# The scan's sum of its int8 q side by an MMA (`_scan_block_max`) where its grid is more than the
# SCAN_PROGRAMS_PER_SM programs per SM that run at once, i.e. where the scan is bound by instruction
# throughput; where it is one wave each program's step latency matters more; and in the one-wave grid
# (SCAN_WAVE_MIN_STEPS). None: by those rules; True / False: always / never (False also keeps the default grid).
SCAN_SUM_BY_MMA: bool | None = None
# A scan grid under one wave of the MMA-sum form (head_dim >= SCAN_TOKENS_AS_M_MIN_DIM; B = 1 at Llama-3.1-8B
# shapes) becomes one full wave of it where its programs would take at least this many block steps: shorter
# programs pay off only from there (the floor).
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
    memory (BS * D <= 128 * 128: 113 KB each on sm_90), else 2 (3 is faster where it fits)."""
    return 3 if block_size * head_dim <= 128 * 128 else 2


def attend_resident_per_sm(args: tuple, kwargs: dict, dtype: torch.dtype, kv_dtype: torch.dtype,
                           device: torch.device) -> int:
    """Attend programs one SM runs at once, from the compiled kernel's registers and shared memory
    (`kernels.occupancy`, once per specialisation); 2 in the interpreter, which has no SMs."""
    if device.type != "cuda":
        return 2
    key = ("ffd_attend", dtype, kv_dtype, tuple(kwargs.items()))   # built in a fixed order
    return resident_ctas(_attend_kernel, key, (*args, 0), kwargs, device)


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


@dataclass(frozen=True, eq=False)
class FFDDecodePlan:
    """The host work of one step's FFD decode, shared by every layer of the step (the layers run one
    after the other on one stream, and each run leaves the `sync` counters zero).

    A CUDA graph that captures `run_ffd_decode` freezes this plan's workspaces, grids and split counts."""

    batch: int
    num_heads: int
    kv_heads: int
    dim: int
    block_size: int
    table_width: int                 # block_tables.shape[1] of every run
    dtype: torch.dtype
    params: FFDParams
    has_key_page_map: bool           # HAS_KMAP: runs pass key_page_map
    write_masks: bool                # WRITE_MASK: runs pass masks
    count_stats: bool                # COUNT: runs pass stats
    max_blocks: int
    delta: float                     # δ in log2 units, finite
    sync: torch.Tensor | None        # int32 counters, zero between runs (`ffd_sync_buffer`)
    pm: torch.Tensor | None          # fp32 pseudo-max of each (row, slice)
    bmax: torch.Tensor | None        # fp32 2-bit max of each (row, block)
    flags: torch.Tensor | None       # int32 page id of each kept block, -1 dropped
    slots: torch.Tensor | None       # int32 page ids of each attend split's kept blocks
    p_acc: torch.Tensor | None       # fp32 partial numerators of each (row, split)
    p_ml: torch.Tensor | None        # fp32 partial (max, sum) of each (row, split)
    scan_grid: tuple[int, int, int] = (0, 0, 0)
    scan_consts: dict[str, Any] = field(default_factory=dict)      # constexprs and launch options
    attend_grid: tuple[int, int, int] = (0, 0, 0)
    attend_options: dict[str, Any] = field(default_factory=dict)   # constexprs and launch options
    resident_programs: int = 0
    merge_grid: tuple[int, int, int] = (0, 0, 0)
    merge_options: dict[str, Any] = field(default_factory=dict)

    @property
    def shapes(self) -> tuple[int, ...]:
        return (self.batch, self.num_heads, self.dim, self.block_size, self.kv_heads, self.dim, self.table_width)


def plan_ffd_decode(batch: int, num_heads: int, kv_heads: int, dim: int, block_size: int, table_width: int, *,
                    dtype: torch.dtype, device: torch.device, params: FFDParams, kv_dtype: torch.dtype | None = None,
                    num_splits: int | None = None, has_key_page_map: bool = False, write_masks: bool = False,
                    count_stats: bool = False, resident_programs: int | None = None, pdl: bool | None = None,
                    sync: torch.Tensor | None = None) -> FFDDecodePlan:
    """Plan an FFD decode of q [batch, num_heads, dim] (`dtype`) over pages [N, block_size, kv_heads, dim]
    (`kv_dtype`, default `dtype`) through block tables [batch, table_width], from shapes only: grids,
    split counts, constexprs and the workspaces. `has_key_page_map`, `write_masks`, `count_stats`: whether
    the runs pass key_page_map, masks, stats (each a constexpr). `num_splits`, `resident_programs`,
    `pdl`, `sync` as in `ffd_decode`; on a GPU the scan's and the attend's residency are read from the
    compiled kernels here (once per specialisation). Raises for `pdl=True` where the GPU has no such
    launch and for a `sync` buffer too small for the batch."""
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    bs = block_size
    max_blocks = max(1, table_width)
    delta = params.delta_log2 if math.isfinite(params.delta_log2) else 1e30
    flags_of: dict[str, Any] = dict(
        batch=batch, num_heads=num_heads, kv_heads=kv_heads, dim=dim, block_size=bs, table_width=table_width,
        dtype=dtype, params=params, has_key_page_map=has_key_page_map, write_masks=write_masks,
        count_stats=count_stats, max_blocks=max_blocks, delta=delta)
    if batch == 0:
        return FFDDecodePlan(**flags_of, sync=None, pm=None, bmax=None, flags=None, slots=None, p_acc=None,
                             p_ml=None)
    group = num_heads // kv_heads
    dev = device
    if dev.type == "cuda" and dev.index is None:   # "cuda" names the current device; tensors name it with its index
        dev = torch.device("cuda", torch.cuda.current_device())
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
    splits = triton.next_power_of_2(int(num_splits or choose_splits(batch, kv_heads, dev, ATTEND_PROGRAMS_PER_SM)))
    min_per, dense_min_per = (1, 1) if num_splits else (MIN_PER_SPLIT, DENSE_MIN_PER_SPLIT)
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
    common = {"NUM_HEADS": num_heads, "NUM_KV_HEADS": kv_heads, "GROUP": group, "BLOCK_H": block_h, "D": dim,
              "D4": dim // 4, "BS": bs, "UPCAST": interpreting()}
    tokens_as_m = dim >= SCAN_TOKENS_AS_M_MIN_DIM
    scan_n = triton.next_power_of_2(group) if tokens_as_m else block_h
    bmax = torch.empty(batch * kv_heads * max_blocks * scan_n, dtype=torch.float32, device=dev)
    # the per-layer tensors of a probe compile: stand-ins of their dtypes, contiguous strides
    q_strides, kv_strides, bt_stride = contiguous_strides(batch, num_heads, kv_heads, dim, bs, max_blocks)

    def probe_layer() -> list:
        return probe_tensors(dev, dtype, kv_dtype, torch.int32, torch.uint8, torch.float32, FP8, torch.int32,
                             torch.int32)

    def scan_probe_args() -> tuple:
        q, kv, kmap, codes, scales, residual, table, lens = probe_layer()
        masks = probe_tensors(dev, torch.int8)[0] if write_masks else flags
        return (q, kv, kv, kmap, codes, scales, residual, table, lens, pm, bmax, flags, masks, sync, *q_strides,
                *kv_strides, bt_stride, max_blocks if write_masks else 0, max_blocks, LOG2E, delta,
                params.sink_tokens, params.local_window, params.min_ffd_len)

    # the pseudo-max parts first: the lowest program ids, dispatched before the scan programs that wait on them
    scan_consts = dict(BPP=SCAN_BLOCKS_PER_STEP, SINK_PARTS=sink_parts, NUM_PARTS=num_parts,
                       PARTS_PAD=triton.next_power_of_2(pm_programs), HAS_KMAP=has_key_page_map,
                       WRITE_MASK=write_masks, SCAN_N=scan_n, TOKENS_AS_M=tokens_as_m, PM_SLICE=pm_slice,
                       DECIDE_CHUNK=DECIDE_CHUNK, PDL=pdl, num_warps=SCAN_WARPS, num_stages=SCAN_STAGES, **common)
    scan_splits = choose_splits(batch, kv_heads, dev, SCAN_PROGRAMS_PER_SM)
    sum_by_mma = scan_sum_by_mma(batch * kv_heads * scan_splits, units)
    if dev.type == "cuda" and tokens_as_m and SCAN_SUM_BY_MMA is not False \
            and -(-max_blocks // scan_splits) >= SCAN_WAVE_MIN_STEPS:
        # under one wave of the MMA-sum form (B = 1): one full wave of it, so shorter programs
        consts = {**scan_consts, "SUM_BY_MMA": True}
        wave = resident_ctas(_scan_kernel, ("ffd_scan", dtype, tuple(consts.items())), scan_probe_args(), consts,
                             dev) * units // (batch * kv_heads) - pm_programs
        if wave > scan_splits:
            scan_splits, sum_by_mma = wave, True
    attend_options = dict(NUM_SPLITS=splits, MIN_PER_SPLIT=min_per, DENSE_MIN_PER_SPLIT=dense_min_per,
                          PER_MAX=per_max, FLAG_CHUNK=flag_chunk, ONE_CHUNK=flag_chunk >= max_blocks,
                          COUNT=count_stats, HAS_KMAP=has_key_page_map, PDL=pdl, **common)
    attend_options.update({"num_warps": 4 if dim <= 128 else 8, "num_stages": attend_stages(bs, dim), **dependent})
    if resident_programs is None and not num_splits:
        q, kv, kmap, codes, scales, residual, table, lens = probe_layer() if dev.type == "cuda" else [None] * 8
        attend_probe_args = (q, kv, kv, kmap, codes, scales, residual, table, lens, flags, slots, p_acc, p_ml,
                             p_ml, sync, *q_strides, *kv_strides, bt_stride, max_blocks, LOG2E, params.min_ffd_len)
        resident_programs = attend_resident_per_sm(attend_probe_args, attend_options, dtype, kv_dtype, dev) \
            * units - batch * kv_heads
    dc = min(dim, max(16, MERGE_TILE // splits))
    merge_options = dict(NUM_SPLITS=splits, NUM_HEADS=num_heads, NUM_KV_HEADS=kv_heads, D=dim, DC=dc, PDL=pdl,
                         num_warps=4, **dependent)
    return FFDDecodePlan(**flags_of, sync=sync, pm=pm, bmax=bmax, flags=flags, slots=slots, p_acc=p_acc, p_ml=p_ml,
                         scan_grid=(batch, kv_heads, pm_programs + scan_splits),
                         scan_consts={**scan_consts, "SUM_BY_MMA": sum_by_mma},
                         attend_grid=(batch, kv_heads, splits), attend_options=attend_options,
                         resident_programs=max(0, int(resident_programs or 0)),
                         merge_grid=(batch, num_heads, dim // dc), merge_options=merge_options)


def run_ffd_decode(plan: FFDDecodePlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   codes: torch.Tensor, scales: torch.Tensor, residual: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, *, scale: float, stats: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, masks: torch.Tensor | None = None,
                   key_page_map: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's FFD decode under `plan`: q[B, Hq, D] -> out[B, Hq, D], arguments as in `ffd_decode`.
    The tensors must have the layouts `check_ffd_inputs` accepts (checked once by the caller, not
    here), the plan's shapes, and `stats` / `masks` / `key_page_map` exactly when the plan says so
    (checked here). Allocates nothing but `out` when it is None."""
    got = (*q.shape, *k_cache.shape[1:], block_tables.shape[1])
    if got != plan.shapes:
        raise ValueError(f"FFD decode: q / cache pages / block-table width {got} do not match the plan's "
                         f"(B, Hq, D, BS, Hkv, D, width) = {plan.shapes}")
    if (stats is not None, masks is not None, key_page_map is not None) != \
            (plan.count_stats, plan.write_masks, plan.has_key_page_map):
        raise ValueError(f"FFD decode: the plan takes stats={plan.count_stats}, masks={plan.write_masks}, "
                         f"key_page_map={plan.has_key_page_map}; got stats={stats is not None}, "
                         f"masks={masks is not None}, key_page_map={key_page_map is not None}")
    out = torch.empty_like(q) if out is None else out
    if plan.batch == 0:
        return out
    p = plan.params
    kmap = seq_lens if key_page_map is None else key_page_map      # any int32 tensor when unused
    q_strides = (q.stride(0), q.stride(1))
    kv_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    _scan_kernel[plan.scan_grid](q, k_cache, v_cache, kmap, codes, scales, residual, block_tables, seq_lens, plan.pm,
                                 plan.bmax, plan.flags, masks if masks is not None else plan.flags, plan.sync,
                                 *q_strides, *kv_strides, block_tables.stride(0),
                                 masks.shape[2] if masks is not None else 0, plan.max_blocks, scale * LOG2E,
                                 plan.delta, p.sink_tokens, p.local_window, p.min_ffd_len, **plan.scan_consts)
    _attend_kernel[plan.attend_grid](q, k_cache, v_cache, kmap, codes, scales, residual, block_tables, seq_lens,
                                     plan.flags, plan.slots, plan.p_acc, plan.p_ml,
                                     stats if stats is not None else plan.p_ml, plan.sync, *q_strides, *kv_strides,
                                     block_tables.stride(0), plan.max_blocks, scale * LOG2E, p.min_ffd_len,
                                     plan.resident_programs, **plan.attend_options)
    _merge_kernel[plan.merge_grid](out, plan.p_acc, plan.p_ml, plan.sync, out.stride(0), out.stride(1),
                                   **plan.merge_options)
    return out


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
    optional) += (full blocks, kept blocks) over (sequence, KV head) pairs; `masks` (int8 [B, Hkv,
    >= max blocks], optional, for tests) gets 1/0 for every full block the kernel visited.
    `num_splits` is rounded up to a power of two. `resident_programs`: the attend programs to spread
    the batch's kept blocks over (default: those the GPU runs at once minus one per (sequence, KV
    head), whose ceil() may each add one; 0, and the default with `num_splits`: only the per-sequence
    rule). `pdl`: the attend and the merge start while the previous launch ends (programmatic
    dependent launch; default: where the GPU has it, False: plain stream order). `sync`: the
    launches' int32 counters (`ffd_sync_buffer`), zero between calls and left zero by each, so one
    buffer serves every call on a stream (default: a zeroed one per call). Raises for shapes the
    kernel does not serve, for `pdl=True` where the GPU has no such launch, and for a `sync` buffer
    too small for the batch. Plans (`plan_ffd_decode`) and runs (`run_ffd_decode`).
    """
    batch, num_heads, dim = q.shape
    check_ffd_inputs("FFD decode", q, k_cache, v_cache, block_tables, seq_lens, params)
    plan = plan_ffd_decode(batch, num_heads, k_cache.shape[2], dim, k_cache.shape[1], block_tables.shape[1],
                           dtype=q.dtype, device=q.device, params=params, kv_dtype=k_cache.dtype,
                           num_splits=num_splits, has_key_page_map=key_page_map is not None,
                           write_masks=masks is not None, count_stats=stats is not None,
                           resident_programs=resident_programs, pdl=pdl, sync=sync)
    return run_ffd_decode(plan, q, k_cache, v_cache, codes, scales, residual, block_tables, seq_lens, scale=scale,
                          stats=stats, out=out, masks=masks, key_page_map=key_page_map)
