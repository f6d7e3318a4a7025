"""FFD Triton kernels (interpreter on CPU, real GPU when present) against the torch reference:
quantize-on-write bit-exact, δ = ∞ equal to dense attention over the refined keys, block masks
equal to the reference's, every block visited at 0..257 blocks, tails 0, 1, BS-1, GQA 1/3/4/7,
head_dim 64 and 128, "auto" rows dense, sparsity counters; the attend pass's split invariants
(every kept block attended exactly once at any split count, long flag rows); the GPU-only PTX
(code levels, the scan's int8 code lanes and arithmetic, e4m3 bits, the refined key planes) emulated;
the scan's instruction mix compiled for sm_90 (`tests/support/scan_sass.py`); the attend's residency read from
the compiled kernel (GPU).

Tolerances: the interpreter computes in fp32 (UPCAST), so outputs match the fp32 reference to
1e-5 and masks exactly. Compiled on a GPU the dots take bf16 operands (~1e-3 relative) and the
scan an int8 q side (steps of 1/127 of its largest term): outputs are checked to a relative L2 error
of 1e-2 (printed), and a block whose 2-bit max sits within that rounding of its threshold may flip,
so a few mask differences are allowed (and printed).
"""
from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels.ffd.decode as ffd_mod
from kernels.ffd.decode import attend_slots, ffd_decode, ffd_sync_buffer, plan_ffd_decode, run_ffd_decode
from kernels.ffd.ptx import (
    INT8_Q_MAX,
    INT_ROUND,
    INT_ROUND_BITS,
    RES_BITS_EXP,
    RES_Q_SCALE,
    RES_UNSCALE,
    plane_asm,
    refined_plane_asm,
    residual_asm,
    scan_plane_asm,
)
from kernels.ffd.quantize import quantize_on_write
from kernels.ffd.reference import (
    FP8,
    RESIDUAL_SCALE,
    dense_over_refined_ref,
    ffd_decode_ref,
    quantize_blocks_ref,
)
from kernels.occupancy import resident_ctas
from kernels.vendor import interpreting, programmatic_launch
from tests.support.ffd_helpers import empty_pages, paged_case, params

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EXACT = interpreting()                      # fp32 arithmetic (interpreter) vs bf16 dots (compiled)
REL_L2 = 1e-5 if EXACT else 1e-2
MASK_SLACK = 0 if EXACT else 0.005          # fraction of blocks that may flip at the threshold (compiled)


def check_close(out, ref, what="out", bound=None):
    """Relative L2 error of out vs ref under the device's bound; printed on a GPU."""
    bound = REL_L2 if bound is None else bound
    err = float((out.cpu().double() - ref.cpu().double()).norm() / ref.cpu().double().norm().clamp_min(1e-30))
    if not EXACT:
        print(f"{what}: rel L2 error {err:.2e} (bound {bound:g})")
    assert err < bound, f"{what}: rel L2 error {err:.2e} >= {bound:g}"
    return err


def check_masks(masks, ref_masks, lens, bs, slack: float = MASK_SLACK):
    """Kernel masks vs the reference's; returns the number of differing blocks (0 in the interpreter)."""
    diff = total = 0
    for b, n in enumerate(lens):
        nq = n // bs
        assert (masks[b, :, :nq] >= 0).all()                          # visited
        assert (masks[b, :, nq:] == -1).all()                         # nothing past the full blocks
        diff += int((masks[b, :, :nq].cpu().bool() != ref_masks[b]).sum())
        total += ref_masks[b].numel()
    if not EXACT:
        print(f"masks: {diff} of {total} blocks differ")
    assert diff <= slack * total, f"{diff} of {total} blocks differ"
    return diff


def check_stats(stats, ref_stats, masks, lens, bs):
    """Counters: exactly the reference's in the interpreter; on a GPU consistent with the masks."""
    if EXACT:
        assert stats.tolist() == [ref_stats["ffd_blocks_total"], ref_stats["ffd_blocks_kept"]]
    else:
        kept = sum(int(masks[b, :, :n // bs].sum()) for b, n in enumerate(lens))
        assert stats.tolist() == [ref_stats["ffd_blocks_total"], kept]


def to_dev(case):
    q, k, v, qp, tables, seq = case
    for name in ("codes", "scales", "residual"):
        setattr(qp, name, getattr(qp, name).to(DEV))
    return q.to(DEV), k.to(DEV), v.to(DEV), qp, tables.to(DEV), seq.to(DEV)


def run(case, p, **kw):
    q, k, v, qp, tables, seq = case
    return ffd_decode(q, k, v, qp.codes, qp.scales, qp.residual, tables, seq, scale=q.shape[-1] ** -0.5,
                      params=p, **kw)


def test_quantize_on_write_is_bit_exact():
    gen = torch.Generator().manual_seed(0)
    bs, heads, dim = 64, 2, 64
    k = torch.randn(5, bs, heads, dim, generator=gen) * torch.logspace(-4, 3, dim)
    k[1, :, 0, 3] = 0.0                                          # an all-zero channel
    # keys a hair off the 2-bit levels: residuals in e4m3's subnormal range even after scaling
    k[2, :, 1, 5] = (torch.arange(bs) % 4 - 1.5) * 2.0 + 2.0 * 2.0 ** -16 * (torch.arange(bs) % 9 - 4)
    k[2, 0, 1, 5] = 3.0                                          # absmax 3: s = 2, levels -3, -1, 1, 3
    k = k.to(DEV)
    mine = empty_pages(5, bs, heads, dim, DEV)
    # a prefill chunk filling pages 3 and 1 and half of page 4, then a decode token filling page 2
    slots = torch.cat([torch.arange(3 * bs, 4 * bs), torch.arange(bs, 2 * bs), torch.arange(4 * bs, 4 * bs + 30),
                       torch.tensor([-1, 3 * bs - 1])]).to(DEV)
    quantize_on_write(k, mine.codes, mine.scales, mine.residual, slots)
    c, s, r = quantize_blocks_ref(k[[1, 2, 3]].cpu())
    assert torch.equal(mine.codes[[1, 2, 3]].cpu(), c) and torch.equal(mine.scales[[1, 2, 3]].cpu(), s)
    assert torch.equal(mine.residual[[1, 2, 3]].cpu().view(torch.uint8), r.view(torch.uint8))
    untouched = [0, 4]
    assert not mine.codes[untouched].any() and not mine.scales[untouched].any()


@pytest.mark.parametrize("num_blocks, tail", [(0, 1), (0, 63), (1, 0), (1, 1), (2, 63), (3, 0)])
@pytest.mark.parametrize("group, dim", [(1, 64), (3, 128), (4, 64), (7, 64)])
def test_delta_inf_equals_dense_over_refined_keys(num_blocks, tail, group, dim):
    bs = 64
    length = num_blocks * bs + tail
    case = to_dev(paged_case([length, bs + 5], bs=bs, kv_heads=2, group=group, dim=dim, seed=length + group))
    p = params(bs=bs, delta_log2=math.inf, sink=4, window=32)
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    out = run(case, p, stats=stats, num_splits=2)
    q, k, v, qp, tables, seq = case
    ref = dense_over_refined_ref(q.cpu(), k.cpu(), v.cpu(), qp_cpu(qp), tables.cpu(), seq.cpu(), scale=dim ** -0.5,
                                 block_size=bs)
    check_close(out, ref)
    full = 2 * (num_blocks + 1)
    assert stats.tolist() == [full, full]


def qp_cpu(qp):
    from kernels.ffd.reference import QuantizedPages
    return QuantizedPages(qp.codes.cpu(), qp.scales.cpu(), qp.residual.cpu())


def check_against_reference(case, p, lens, bs, mask_slack: float = MASK_SLACK, **kw):
    """Run the kernel (keyword arguments `kw`) with masks and stats; masks (up to `mask_slack` of them
    may flip when compiled), stats and output against the torch rule. Returns the kernel's output and
    the rule's stats."""
    q, k, v, qp, tables, seq = case
    masks = torch.full((len(lens), k.shape[2], tables.shape[1]), -1, dtype=torch.int8, device=DEV)
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    out = run(case, p, stats=stats, masks=masks, **kw)
    ref_masks, ref_stats = [], {}
    ref = ffd_decode_ref(q.cpu(), k.cpu(), v.cpu(), qp_cpu(qp), tables.cpu(), seq.cpu(), scale=0.125, params=p,
                         stats=ref_stats, masks=ref_masks)
    diff = check_masks(masks, ref_masks, lens, bs, mask_slack)
    check_stats(stats, ref_stats, masks, lens, bs)
    check_close(out, ref, bound=REL_L2 if diff == 0 else 5e-2)   # a flipped block moves the output
    return out, ref_stats


@pytest.mark.parametrize("num_blocks", [127, 128, 129, 257])
def test_every_block_is_visited_and_masks_equal_the_reference(num_blocks):
    bs = 64
    lens = [num_blocks * bs + 63, num_blocks * bs, 3 * bs + 1]
    case = to_dev(paged_case(lens, bs=bs, kv_heads=1, group=4, dim=64, seed=num_blocks))
    p = params(bs=bs, delta_log2=3.0, sink=4, window=64)
    _, ref_stats = check_against_reference(case, p, lens, bs, num_splits=5)
    assert ref_stats["ffd_blocks_kept"] < ref_stats["ffd_blocks_total"]   # it really prunes


@pytest.mark.parametrize("group, dim", [(1, 64), (3, 64), (4, 128), (7, 64)])
def test_pruned_output_matches_reference_with_gqa(group, dim):
    bs = 64
    lens = [9 * bs + 17, 4 * bs, 2 * bs - 1]
    case = to_dev(paged_case(lens, bs=bs, kv_heads=2, group=group, dim=dim, seed=group * dim))
    p = params(bs=bs, delta_log2=2.0, sink=1, window=16)
    q, k, v, qp, tables, seq = case
    masks = torch.full((3, 2, 10), -1, dtype=torch.int8, device=DEV)
    out = run(case, p, masks=masks)
    ref_masks = []
    ref = ffd_decode_ref(q.cpu(), k.cpu(), v.cpu(), qp_cpu(qp), tables.cpu(), seq.cpu(), scale=dim ** -0.5,
                         params=p, masks=ref_masks)
    diff = check_masks(masks, ref_masks, lens, bs)
    check_close(out, ref, bound=REL_L2 if diff == 0 else 5e-2)


@pytest.mark.parametrize("num_splits", [3, None])     # None: the default split rule (DENSE_MIN_PER_SPLIT)
def test_auto_rows_below_the_crossover_are_dense(num_splits):
    bs = 64
    case = to_dev(paged_case([5 * bs + 3, 2 * bs + 7, 0], bs=bs, kv_heads=2, group=2, dim=64, seed=4))
    p = params(bs=bs, delta_log2=1.0, sink=0, window=8, min_ffd_len=3 * bs)
    q, k, v, qp, tables, seq = case
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    out = run(case, p, stats=stats, num_splits=num_splits)
    ref_stats = {}
    ref = ffd_decode_ref(q.cpu(), k.cpu(), v.cpu(), qp_cpu(qp), tables.cpu(), seq.cpu(), scale=0.125, params=p,
                         stats=ref_stats)
    check_close(out, ref)
    assert stats[0] == ref_stats["ffd_blocks_total"] == 10
    assert EXACT is False or stats[1] == ref_stats["ffd_blocks_kept"]


def test_backend_glue_triton_equals_reference():
    """The engine backend's Triton path (store, quantize on write, prefill, decode, counters)
    against its torch path, on the same writes: prefill of 3 sequences, then two decode steps."""
    from engine.attention.select import make_attention_backend
    from engine.config import FlashDecodingConfig
    from tests.support.attention_metadata import cache_spec, kernel_metadata, planned
    fd = FlashDecodingConfig(kernel="ffd", ffd_block_size=64, delta=2.0, sink_tokens=4, local_window=64)
    gen = torch.Generator().manual_seed(2)
    backends = [make_attention_backend(fd, torch.device("cpu"), "cpu") for _ in range(2)]
    backends[1].triton = True
    for backend in backends:    # every exact K page kept (the "auto" layout); the pool: test_ffd_compact.py
        backend.compact = False
    kv = [torch.zeros(2, 1, 12, 64, 2, 64).to(DEV) for _ in range(2)]
    for backend, cache in zip(backends, kv, strict=True):
        backend.allocate(cache_spec(cache[1], num_heads=8), cache[0], cache[1])
    lens = [200, 130, 63]
    tables = torch.tensor([[1, 5, 2, 9], [3, 4, 10, 0], [7, 0, 0, 0]], dtype=torch.int32, device=DEV)

    def slot(b: int, p: int) -> int:
        return int(tables[b, p // 64]) * 64 + p % 64

    slots = torch.tensor([slot(b, p) for b, n in enumerate(lens) for p in range(n)], device=DEV)
    k = torch.randn(len(slots), 2, 64, generator=gen).to(DEV)
    v = torch.randn(len(slots), 2, 64, generator=gen).to(DEV)
    outs, counters = [], []
    for backend, cache in zip(backends, kv, strict=True):
        backend.store(0, k, v, cache[0, 0], cache[1, 0], slots)
        qsl = torch.tensor([0, 200, 330, 393], dtype=torch.int32, device=DEV)
        q_prompt = torch.randn(len(slots), 8, 64, generator=torch.Generator().manual_seed(5)).to(DEV)
        prompt_meta = kernel_metadata(tables, torch.tensor(lens, device=DEV, dtype=torch.int32), qsl)
        prompt_out = backend.prefill(0, q_prompt, cache[0, 0], cache[1, 0], prompt_meta, scale=0.125)
        steps, c = [], {}
        for step in range(2):                                        # the 63-token sequence fills its page
            new = torch.tensor([slot(b, n + step) for b, n in enumerate(lens)], device=DEV)
            g = torch.Generator().manual_seed(10 + step)
            backend.store(0, torch.randn(3, 2, 64, generator=g).to(DEV), torch.randn(3, 2, 64, generator=g).to(DEV),
                          cache[0, 0], cache[1, 0], new)
            seq = torch.tensor([n + step + 1 for n in lens], dtype=torch.int32, device=DEV)
            q = torch.randn(3, 8, 64, generator=g).to(DEV)
            step_counters: dict = {}                                 # one step's, as the engine keeps them
            meta = planned(backend, kernel_metadata(tables, seq, counters=step_counters))
            steps.append(backend.decode(0, q, cache[0, 0], cache[1, 0], meta, scale=0.125))
            for key, val in step_counters.items():
                c[key] = c.get(key, 0.0) + float(val)
        outs.append(torch.cat([prompt_out.cpu(), torch.stack(steps).cpu().flatten(0, 1)]))
        counters.append({key: float(val) for key, val in c.items()})
    check_close(outs[1], outs[0])
    assert counters[1]["ffd_blocks_total"] == counters[0]["ffd_blocks_total"] == 2 * 2 * (3 + 2 + 1)
    assert EXACT is False or counters[1] == counters[0]
    assert torch.equal(backends[1].cache.codes, backends[0].cache.codes)


def test_rope_fused_write_then_post_store_equals_the_backend_store():
    """Every exact K page kept (the "auto" layout) on the Triton path: the attention layer writes K/V
    with RoPE in one launch and then calls the backend's `post_store`, which must leave the pages and
    the quantized keys (codes, scales, residuals) as RoPE followed by the backend's own store does.
    The compact layout (a page map) keeps the unfused write."""
    from engine.attention.backend import AttentionBackend
    from engine.attention.layer import Attention, AttentionMetadata, forward_context
    from engine.attention.select import make_attention_backend
    from engine.config import FlashDecodingConfig
    from engine.model.layers import RotaryEmbedding
    from tests.support.attention_metadata import cache_spec
    fd = FlashDecodingConfig(kernel="auto", ffd_block_size=64, delta=2.0, ffd_crossover_tokens=4096)
    rope = RotaryEmbedding(64, 64, max_position=512, base=10000.0).to(DEV)
    gen = torch.Generator().manual_seed(3)
    lens, heads, kv_heads = [150, 64], 4, 2
    tables = torch.tensor([[3, 1, 6], [5, 0, 0]], dtype=torch.int32, device=DEV)
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEV)
    slots = torch.tensor([int(tables[b, p // 64]) * 64 + p % 64 for b, n in enumerate(lens) for p in range(n)],
                         device=DEV)
    q = torch.randn(len(slots), heads * 64, generator=gen).to(DEV)
    k = torch.randn(len(slots), kv_heads * 64, generator=gen).to(DEV)
    v = torch.randn(len(slots), kv_heads * 64, generator=gen).to(DEV)
    meta = AttentionMetadata(positions=positions, slot_mapping=slots,
                             query_start_loc=torch.tensor([0, 150, 214], dtype=torch.int32, device=DEV),
                             seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV), block_tables=tables,
                             max_query_len=150, is_decode_only=False)
    results = []
    for fused in (True, False):
        backend = make_attention_backend(fd, torch.device("cpu"), "cpu")
        backend.triton = True
        cache = torch.zeros(2, 1, 8, 64, kv_heads, 64, device=DEV)
        backend.allocate(cache_spec(cache[1], num_heads=heads), cache[0], cache[1])
        assert backend.fuse_rope_store and type(backend).post_store is not AttentionBackend.post_store
        backend.fuse_rope_store = fused
        layer = Attention(heads, kv_heads, 64, 0.125, layer_idx=0)
        layer.k_cache, layer.v_cache = cache[0, 0], cache[1, 0]
        with forward_context(meta, backend):
            out = layer(q, k, v, rotary=rope, positions=positions)
        results.append((out, cache, backend.cache.codes.clone(), backend.cache.scales.clone(),
                        backend.cache.residual.float()))
    (out_f, cache_f, *quant_f), (out_u, cache_u, *quant_u) = results
    assert torch.equal(cache_f[1], cache_u[1])                    # V copied bit for bit
    check_close(cache_f[0], cache_u[0])                           # rotated K: one rounding order apart
    written = torch.tensor([3, 1, 5], device=DEV)                 # the three full blocks were quantized
    assert quant_f[1][0, written].abs().sum(-1).min() > 0
    for got, want in zip(quant_f, quant_u, strict=False):
        if got.dtype == torch.uint8:                              # 2-bit codes: at most a few ties
            assert (got != want).float().mean() < 1e-3
        else:
            check_close(got, want)
    check_close(out_f, out_u)
    compact = make_attention_backend(FlashDecodingConfig(kernel="ffd", ffd_block_size=64), torch.device("cpu"), "cpu",
                                     max_num_seqs=2, max_num_batched_tokens=256)
    compact.triton = True
    compact_v = torch.zeros(1, 8, 64, kv_heads, 64, device=DEV)
    compact.allocate(cache_spec(compact_v, num_heads=heads),
                     torch.zeros(1, compact.key_cache_pages(8), 64, kv_heads, 64, device=DEV), compact_v)
    assert compact.exact is not None and not compact.fuse_rope_store


# ----- the attend pass's split invariants --------------------------------------------------------

def test_attend_slots_cover_every_kept_block():
    """per = max(ceil(kept / splits), min_per, min(balance, PER_MAX)) fits PER_MAX slots and the
    splits' rank ranges cover all kept blocks, for every kept <= max_blocks and any batch balance
    term (the proof in `attend_slots`, checked)."""
    for splits in (1, 2, 4, 8, 16, 32, 64, 128):
        for min_per in (1, 2):
            for max_blocks in range(1, 300):
                per_max = attend_slots(max_blocks, splits, min_per)
                assert per_max & (per_max - 1) == 0
                kept = torch.arange(max_blocks + 1)
                for balance in (0, 1, 3, 40, 10**6):
                    per = torch.clamp(torch.clamp(-(-kept // splits), min=min_per), min=min(balance, per_max))
                    assert int(per.max()) <= per_max
                    assert bool((splits * per >= kept).all())


@pytest.mark.parametrize("resident,num_splits", [(1, None), (3, 4), (1000, 4)])
def test_batch_balanced_shares_attend_every_kept_block_once(resident, num_splits):
    """The attend shares sized from the batch's kept-block counter (`resident_programs`): 1 gives
    each split as many blocks as its slots hold, 3 a share between that and the per-sequence rule,
    1000 (with 4 splits) the per-sequence rule. A skewed batch (one long sequence, short and empty
    ones) still gets the reference's masks, statistics and output."""
    bs = 64
    lens = [130 * bs + 7, 9 * bs + 63, 0, 2 * bs + 1, 5]
    case = to_dev(paged_case(lens, bs=bs, kv_heads=2, group=4, dim=64, seed=21))
    p = params(bs=bs, delta_log2=2.0, sink=4, window=64)
    _, ref_stats = check_against_reference(case, p, lens, bs, resident_programs=resident, num_splits=num_splits)
    assert ref_stats["ffd_blocks_kept"] < ref_stats["ffd_blocks_total"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="occupancy of a compiled kernel: GPU only")
def test_attend_residency_is_read_from_the_compiled_kernel():
    """The one-round share rule plans for the attend programs an SM really holds: read from the
    compiled kernel, so head_dim 64 (fewer registers, less shared memory) holds at least as many as
    128; on sm_90, 2 and 3 (registers and shared memory per program, sm_90 compile and Nsight)."""
    from kernels import occupancy
    found = {}
    for dim, group in ((128, 4), (64, 3)):
        case = to_dev(paged_case([5 * 128 + 7, 3 * 128], bs=128, kv_heads=2, group=group, dim=dim, seed=dim,
                                 dtype=torch.bfloat16))
        run(case, params(bs=128, delta_log2=3.0, sink=4, window=128))
        wanted = {("D", dim), ("GROUP", group)}
        found[dim] = [v for key, v in occupancy._CACHE.items()
                      if "ffd_attend" in key and torch.bfloat16 in key and wanted <= set(key[-1])]
    assert found[128] and found[64], found
    assert min(found[64]) >= max(found[128]) >= 1, found
    if torch.cuda.get_device_capability() == (9, 0):
        assert found == {128: [2], 64: [3]}, found


@pytest.mark.parametrize("num_splits", [1, 3, 4])
def test_every_kept_block_attended_once_at_any_split_count(num_splits):
    """δ = ∞ keeps every block: one split holds all 129 of a sequence; 3 (-> 4) and 4 splits give
    uneven shares (9, 7, 2 blocks), fewer kept blocks than splits, and a last split (which owns
    the tail) with no block at all."""
    bs = 64
    lens = [129 * bs + 5, 9 * bs + 63, 7 * bs, 2 * bs + 1]
    case = to_dev(paged_case(lens, bs=bs, kv_heads=2, group=4, dim=64, seed=num_splits))
    p = params(bs=bs, delta_log2=math.inf, sink=4, window=32)
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    out = run(case, p, stats=stats, num_splits=num_splits)
    q, k, v, qp, tables, seq = case
    ref = dense_over_refined_ref(q.cpu(), k.cpu(), v.cpu(), qp_cpu(qp), tables.cpu(), seq.cpu(), scale=0.125,
                                 block_size=bs)
    check_close(out, ref)
    full = 2 * sum(n // bs for n in lens)
    assert stats.tolist() == [full, full]


def test_many_lengths_in_one_batch():
    """Sequences of 0..130 blocks with and without tails in one batch, the default split count."""
    bs = 64
    lens = [0, 1, 63, 64, 65, 130 * bs + 7, 7 * bs, 20 * bs + 33, 2 * bs + 1, 5, 127 * bs, 3 * bs - 1]
    case = to_dev(paged_case(lens, bs=bs, kv_heads=2, group=3, dim=64, seed=11))
    p = params(bs=bs, delta_log2=2.0, sink=4, window=64)
    out, ref_stats = check_against_reference(case, p, lens, bs)
    assert ref_stats["ffd_blocks_kept"] < ref_stats["ffd_blocks_total"]
    assert not out[0].any()                                           # an empty sequence reads as 0


def same_bits_under(monkeypatch, case, p, settings: list[dict]) -> torch.Tensor:
    """Run `case` with each dict of kernels.ffd.decode constants set; assert every output and block mask
    equals the first setting's, bit for bit, and return those masks."""
    results = []
    for consts in settings:
        for name, value in consts.items():
            monkeypatch.setattr(ffd_mod, name, value)
        masks = torch.full((case[0].shape[0], case[1].shape[2], case[4].shape[1]), -1, dtype=torch.int8, device=DEV)
        results.append((run(case, p, masks=masks), masks))
    for out, masks in results[1:]:
        assert torch.equal(results[0][0], out) and torch.equal(results[0][1], masks)
    return results[0][1]


def test_scan_grid_size_and_decision_chunks_change_nothing(monkeypatch):
    """The scan's programs walk their blocks in a grid-stride loop, and decide them DECIDE_CHUNK steps
    at a time: 1 or 64 programs per SM, and chunks of 64 or of 4 steps (at 1 per SM, 35 steps per
    program: nine chunks), give the same bits (output and block masks)."""
    bs = 64
    lens = [70 * bs + 5, 9 * bs, 2 * bs + 1]
    case = to_dev(paged_case(lens, bs=bs, kv_heads=2, group=4, dim=64, seed=9))
    p = params(bs=bs, delta_log2=2.0, sink=4, window=64)
    masks = same_bits_under(monkeypatch, case, p, [{"SCAN_PROGRAMS_PER_SM": per_sm, "DECIDE_CHUNK": chunk}
                                                   for per_sm, chunk in ((1, 64), (64, 64), (1, 4))])
    assert int((masks == 0).sum()) > 0   # blocks really were dropped


@pytest.mark.skipif(EXACT, reason="the interpreter scans with fp32 levels and takes neither form")
@pytest.mark.parametrize("group", [4, 7])
def test_scan_sum_of_the_q_side_by_mma_or_over_channels_gives_the_same_bits(monkeypatch, group):
    """The int8 scan's 1.5 * sum(q side) (head_dim 128) by an all-ones MMA or by a sum over the
    channels, and the MMA form in its one-wave grid (SCAN_WAVE_MIN_STEPS = 1, sized from the compiled
    scan's residency, which this checks was read): the same integers, so the same output and block
    masks, bit for bit. Compiled only: the interpreter scans with fp32 levels and takes neither form."""
    bs = 64
    lens = [40 * bs + 5, 9 * bs, 2 * bs + 1]
    case = to_dev(paged_case(lens, bs=bs, kv_heads=2, group=group, dim=128, seed=13))
    p = params(bs=bs, delta_log2=2.0, sink=4, window=64)
    read = []

    def recording(kernel, key, *args):
        read.append(key[0])
        return resident_ctas(kernel, key, *args)
    monkeypatch.setattr(ffd_mod, "resident_ctas", recording)
    variants = [{"SCAN_SUM_BY_MMA": by_mma, "SCAN_WAVE_MIN_STEPS": wave_steps}
                for by_mma, wave_steps in ((False, 10**9), (True, 10**9), (None, 1))]
    masks = same_bits_under(monkeypatch, case, p, variants)
    assert int((masks == 0).sum()) > 0 and int((masks == 1).sum()) > 0
    assert "ffd_scan" in read


@pytest.mark.parametrize("tokens", [16, 64])
def test_pseudo_max_slices_give_the_reference_threshold(monkeypatch, tokens):
    """The pseudo-max parts run as slices of PM_SLICE tokens (programs of the scan launch). Plain
    random keys (no planted sink, so the maximum can sit in any slice), sinks and a window of
    several blocks each and δ = 0.25 (a quarter bit below the pseudo-max, so a slice read wrong
    moves the masks): masks, counts and output equal the rule's (compiled: up to 2 of the 108 blocks
    may flip, the bf16 scan's rounding being closer to a threshold this tight)."""
    monkeypatch.setattr(ffd_mod, "PM_SLICE", tokens)
    bs = 64
    lens = [40 * bs + 37, 9 * bs, 5 * bs + 3]
    case = to_dev(paged_case(lens, bs=bs, kv_heads=2, group=4, dim=64, seed=13, structured=False))
    p = params(bs=bs, delta_log2=0.25, sink=130, window=200)
    _, ref_stats = check_against_reference(case, p, lens, bs, mask_slack=0 if EXACT else 0.02)
    assert 0 < ref_stats["ffd_blocks_kept"] < ref_stats["ffd_blocks_total"]


def test_sync_buffer_is_left_zero_and_serves_every_call():
    """The decode's counters (kept-block total, per-row READY) are zero again after every call,
    so one buffer serves calls of any batch up to its size with the outputs of fresh zeroed ones."""
    bs = 64
    sync = ffd_sync_buffer(4, 2, DEV)
    for seed, lens in ((21, [30 * bs + 5, 4 * bs]), (22, [2 * bs + 9, 17 * bs, 9 * bs + 63, 1])):
        case = to_dev(paged_case(lens, bs=bs, kv_heads=2, group=2, dim=64, seed=seed))
        p = params(bs=bs, delta_log2=2.0, sink=4, window=64)
        fresh = run(case, p)
        assert torch.equal(run(case, p, sync=sync), fresh)   # the second case reuses what the first left
        assert not sync.any(), sync.tolist()
    with pytest.raises(ValueError, match="sync"):
        run(case, p, sync=ffd_sync_buffer(1, 2, DEV))


def test_one_ffd_plan_serves_two_layers():
    """`plan_ffd_decode` once, `run_ffd_decode` on two layers' pages (fresh random data, a tail of 1,
    a length on a page boundary, a short row): each layer's output, masks and counters equal
    `ffd_decode`'s bit for bit (interpreter) and the torch rule's; the plan's counters stay zero."""
    bs = 64
    lens = [3 * bs + 1, 2 * bs, bs - 1]
    layers = [to_dev(paged_case(lens, bs=bs, kv_heads=2, group=2, dim=64, seed=60 + i)) for i in range(2)]
    p = params(bs=bs, delta_log2=2.0, sink=4, window=64)
    q, k, _, _, tables, _ = layers[0]
    plan = plan_ffd_decode(len(lens), q.shape[1], k.shape[2], q.shape[2], bs, tables.shape[1], dtype=q.dtype,
                           device=DEV, params=p, count_stats=True, write_masks=True)
    for case in layers:
        q, k, v, qp, tables, seq = case
        runs = []
        for planned in (True, False):
            masks = torch.full((len(lens), k.shape[2], tables.shape[1]), -1, dtype=torch.int8, device=DEV)
            stats = torch.zeros(2, dtype=torch.int64, device=DEV)
            if planned:
                out = run_ffd_decode(plan, q, k, v, qp.codes, qp.scales, qp.residual, tables, seq, scale=0.125,
                                     stats=stats, masks=masks)
            else:
                out = run(case, p, stats=stats, masks=masks)
            runs.append((out, masks, stats))
        (out, masks, stats), (alone, alone_masks, alone_stats) = runs
        assert torch.equal(masks, alone_masks) and torch.equal(stats, alone_stats)
        assert torch.equal(out, alone) if EXACT else check_close(out, alone) < REL_L2
        ref_masks, ref_stats = [], {}
        ref = ffd_decode_ref(q.cpu(), k.cpu(), v.cpu(), qp_cpu(qp), tables.cpu(), seq.cpu(), scale=0.125, params=p,
                             stats=ref_stats, masks=ref_masks)
        diff = check_masks(masks, ref_masks, lens, bs)
        check_stats(stats, ref_stats, masks, lens, bs)
        check_close(out, ref, bound=REL_L2 if diff == 0 else 5e-2)
        assert not plan.sync.any()
    with pytest.raises(ValueError, match="stats=True"):
        run_ffd_decode(plan, q, k, v, qp.codes, qp.scales, qp.residual, tables, seq, scale=0.125)


def test_pdl_where_the_gpu_has_none_is_an_error():
    if programmatic_launch(DEV):
        pytest.skip("this GPU has programmatic dependent launch")
    case = to_dev(paged_case([3 * 64 + 1], bs=64, kv_heads=1, group=2, dim=64, seed=3))
    with pytest.raises(ValueError, match="pdl"):
        run(case, params(bs=64, delta_log2=2.0, sink=4, window=64), pdl=True)


def test_flag_rows_longer_than_one_chunk(monkeypatch):
    """Rows of more than FLAG_CHUNK blocks take the chunked count / rank path (prefix sums carried
    across chunks); 16-flag chunks make 129 blocks nine chunks."""
    monkeypatch.setattr(ffd_mod, "FLAG_CHUNK", 16)
    bs = 64
    lens = [129 * bs + 9, 40 * bs, 17 * bs + 1, 16 * bs]
    case = to_dev(paged_case(lens, bs=bs, kv_heads=1, group=4, dim=64, seed=5))
    p = params(bs=bs, delta_log2=2.0, sink=4, window=64)
    check_against_reference(case, p, lens, bs, num_splits=4)


# ----- the GPU-only PTX, emulated ---------------------------------------------------------------

def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32, default mode: byte k of the result is byte (sel nibble k & 7) of {b, a}, or
    that byte's sign replicated when the nibble's bit 3 is set."""
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = 0
    for k in range(4):
        nib = (sel >> (4 * k)) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * k)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX lop3.b32: bit i of the result is bit (a_i * 4 + b_i * 2 + c_i) of the 8-bit table."""
    return sum(((lut >> (((a >> i) & 1) * 4 + ((b >> i) & 1) * 2 + ((c >> i) & 1))) & 1) << i for i in range(32))


def _bf16_fma(a: int, b: int, c: int) -> int:
    """bf16 bits of a * b + c on bf16 bits, rounded once to nearest even (finite normal results)."""

    def value(h: int) -> float:
        return struct.unpack(">f", struct.pack(">I", h << 16))[0]

    mant, exp = math.frexp(value(a) * value(b) + value(c))        # exact in float64 for bf16 operands
    rounded = math.ldexp(round(mant * 256), exp - 8)               # 8 significant bits, ties to even
    return struct.unpack(">I", struct.pack(">f", rounded))[0] >> 16


def run_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """The few b32 PTX instructions our asm strings use, on Python ints ($N operands by name)."""
    regs = dict(inputs)

    def val(x: str) -> int:
        return regs[x] if x in regs else int(x, 0)

    mask = 0xFFFFFFFF
    for ins in asm.strip().strip("{}").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        d, *srcs = [x.strip() for x in args.split(",")]
        v = [val(x) for x in srcs]
        if op == "mov.b32":
            r = v[0]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "shr.b32":
            r = v[0] >> v[1]
        elif op == "shl.b32":
            r = v[0] << v[1]
        elif op == "mad.lo.u32":
            r = v[0] * v[1] + v[2]
        elif op == "prmt.b32":
            r = _prmt(v[0], v[1], v[2])
        elif op == "lop3.b32":
            r = _lop3(*v)
        elif op == "fma.rn.bf16x2":
            r = sum(_bf16_fma(*(x >> (16 * i) & 0xFFFF for x in v)) << (16 * i) for i in range(2))
        else:
            raise AssertionError(f"unexpected PTX {op}")
        regs[d] = r & mask
    return regs


def _bf16_of_bits(words: list[int]) -> torch.Tensor:
    halves = [h for w in words for h in (w & 0xFFFF, w >> 16)]
    return torch.tensor(halves, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()


@pytest.mark.parametrize("j", [0, 1, 2, 3])
def test_code_plane_ptx_gives_the_exact_levels(j):
    """plane_asm(j) on every byte value at every byte position: bf16 of (code - 1.5), code = the byte's
    bits 2j and 2j + 1."""
    for w in _some_words():
        regs = run_ptx(plane_asm(j), {"$2": w})
        got = _bf16_of_bits([regs["$0"], regs["$1"]])
        codes = torch.tensor([(w >> (8 * i + 2 * j)) & 3 for i in range(4)], dtype=torch.float32)
        assert torch.equal(got, codes - 1.5), (hex(w), got, codes)


def _some_words():
    """Every byte value at every byte position of a 32-bit word (256 words)."""
    return [w | ((255 - w) << 8) | (((w * 7) & 255) << 16) | (((w * 13 + 5) & 255) << 24) for w in range(256)]


@pytest.mark.parametrize("j", [0, 1, 2, 3])
def test_scan_plane_ptx_gives_the_codes_as_int8_lanes(j):
    """scan_plane_asm(j): byte i of the result is the code in bits 2j, 2j + 1 of byte i (0..3)."""
    for w in _some_words():
        got = run_ptx(scan_plane_asm(j), {"$1": w})["$0"]
        assert [(got >> (8 * i)) & 0xFF for i in range(4)] == [(w >> (8 * i + 2 * j)) & 3 for i in range(4)], hex(w)


def _scan_int8_block_max(codes, q, s):
    """The GPU scan's arithmetic in torch: codes [4 planes, tokens, D/4], q [4, D/4, rows] (fp32),
    s [4, D/4] -> each row's block max (float64), 2 acc - 3 sum (the kernel's integers) and the rounded
    q side."""
    q_unit = q.abs().amax((0, 1)) / INT8_Q_MAX.value                                   # [rows]
    qn = q * (1.0 / q_unit.clamp_min(1e-30))                                           # |qn| <= 127
    s_max = s.max()
    f = (qn * (s * (1.0 / s_max))[:, :, None] + INT_ROUND.value).float()              # fp32, as the GPU
    v = f.view(torch.int32).long() - INT_ROUND_BITS.value                               # the rounded q side
    acc = sum(codes[j].long() @ v[j] for j in range(4))                                # the int8 MMA, exact
    twice = 2 * acc.max(0).values - 3 * v.sum((0, 1))
    return twice.double() * 0.5 * float(s_max) * q_unit.double(), twice, v


def test_scan_int8_arithmetic_is_the_level_dot_of_the_rounded_q_side():
    """The int8 scan, emulated: the q side stays within [-127, 127]; (2 acc - 3 sum) / 2 * u is
    exactly the level dot (code - 1.5) of the rounded q side (float64); its error against the exact
    fp64 block max is at most sum over channels |level| * u / 2 per row (u = q_unit * s_max), here
    with outlier channels, q from 1e-3 to 1e3 and a zero row (padding)."""
    gen = torch.Generator().manual_seed(4)
    for mag in (1e-3, 1.0, 1e3):
        codes = torch.randint(0, 4, (4, 128, 32), generator=gen)                       # [plane, tokens, D/4]
        q = torch.randn(4, 32, 5, generator=gen) * mag
        q[:, :, 4] = 0.0
        s = torch.rand(4, 32, generator=gen) + 0.05
        s[0, :3] *= 20.0                                                               # outlier channels
        got, twice, v = _scan_int8_block_max(codes, q, s)
        assert int(v.abs().max()) <= 127
        u = (q.abs().amax((0, 1)) / 127.0).double() * float(s.max())
        levels = codes.double() - 1.5
        assert torch.equal(twice.double(), 2 * sum(levels[j] @ v[j].double() for j in range(4)).max(0).values)
        exact = sum(levels[j] @ (q[j].double() * s[j].double()[:, None]) for j in range(4)).max(0).values
        bound = 0.5 * u * 1.5 * 128 * (1 + 1e-6)
        assert ((got - exact).abs() <= bound).all(), (mag, (got - exact).abs() / u)
        assert got[4] == 0.0


def test_residual_ptx_is_e4m3_times_2_pow_minus_120():
    """RES_ASM on every e4m3 byte (NaN excepted): exactly value * 2^-RES_BITS_EXP, subnormals and
    signed zeros included."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    for first in range(0, 256, 4):
        bytes4 = [(first + i) % 256 for i in range(4)]
        regs = run_ptx(residual_asm(), {"$2": sum(x << (8 * i) for i, x in enumerate(bytes4))})
        got = _bf16_of_bits([regs["$0"], regs["$1"]])
        want = values[bytes4] * 2.0 ** -RES_BITS_EXP
        ok = ~torch.isnan(want)
        assert torch.equal(got[ok], want[ok])
        assert torch.equal(torch.signbit(got[ok]), torch.signbit(want[ok]))


@pytest.mark.parametrize("j", [0, 1, 2, 3])
def test_refined_plane_ptx_is_the_refined_key_in_bf16(j):
    """refined_plane_asm(j) on every code byte and every e4m3 residual byte (NaN excepted): bf16 of
    (code - 1.5) + r / R, rounded once, code = bits 2j, 2j + 1 of each code byte."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    for n, w in enumerate(_some_words()):
        res = [(n + 64 * i) % 256 for i in range(4)]            # every residual byte at every position
        regs = run_ptx(refined_plane_asm(j), {"$2": w, "$3": sum(x << (8 * i) for i, x in enumerate(res))})
        got = _bf16_of_bits([regs["$0"], regs["$1"]])
        codes = torch.tensor([(w >> (8 * i + 2 * j)) & 3 for i in range(4)], dtype=torch.float32)
        want = (codes - 1.5 + values[res] / RESIDUAL_SCALE).to(torch.bfloat16).float()   # exact in fp32
        ok = ~torch.isnan(want)
        assert torch.equal(got[ok], want[ok]), (j, hex(w), res, got, want)


def test_residual_dot_scaling_keeps_the_product():
    """The GPU residual dot (q*s*RES_Q_SCALE in bf16) . (e4m3 * 2^-120 in bf16) * RES_UNSCALE
    equals q . (e4m3 * s / R) to bf16 rounding, over q*s from 2^-30 to 2^30 (no overflow / underflow)."""
    gen = torch.Generator().manual_seed(3)
    r = (torch.randn(64, 128, generator=gen) * 40).to(FP8)
    for mag in (2.0 ** -30, 1e-3, 1.0, 1e3, 2.0 ** 30):
        q = torch.randn(16, 128, generator=gen) * mag
        s = torch.rand(128, generator=gen) + 0.1
        want = q @ (r.float() * s / 256.0).T
        q_side = (q * (s * RES_Q_SCALE.value)).to(torch.bfloat16).float()
        r_side = (r.float() * 2.0 ** -RES_BITS_EXP).to(torch.bfloat16).float()
        got = (q_side @ r_side.T) * RES_UNSCALE.value
        assert torch.isfinite(got).all()
        assert float((got - want).norm() / want.norm()) < 1e-2


# ----- the scan's instruction mix, compiled for sm_90 on the CPU ----------------------------------

def _scan_step_opcodes(group: int, sum_by_mma: bool) -> dict:
    """`tests/support/scan_sass.py` in a child process (the tests themselves run under the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.support.scan_sass", "128", str(group), str(int(sum_by_mma))],
                         capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[2],
                         check=False)
    if run.returncode == 3:
        pytest.skip(run.stdout.strip())
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


@pytest.mark.parametrize("group", [4, 7])
def test_scan_loop_is_int8_mma_and_about_half_an_integer_op_per_code(group):
    """At head_dim 128 one scan step (BPP blocks on SCAN_WARPS warps) has the tokens as the MMA's M
    and int8 operands: per warp BPP / SCAN_WARPS * 4 planes * 8 M-tiles * 1 K-step IMMA (m16n8k32,
    query rows padded to 8), 4 more with the q side's sum by MMA, and no HMMA; building the operands
    costs about half a PRMT / LOP3 / SHF per code (the bf16 form took ~0.76, as rows ~1.2); the sum by
    MMA makes the step shorter than the sum over channels (Triton 3.6: 525 against 579 instructions).
    Compiled by Triton for sm_90, counted with the cuobjdump Triton ships."""
    bpp = ffd_mod.SCAN_BLOCKS_PER_STEP
    codes_per_thread = bpp * 128 * 128 // (ffd_mod.SCAN_WARPS * 32)
    steps = {}
    for sum_by_mma in (False, True):
        ops = _scan_step_opcodes(group, sum_by_mma)
        assert ops["IMMA"] == bpp * 4 * (8 + sum_by_mma) // ffd_mod.SCAN_WARPS and "HMMA" not in ops, ops
        assert ops["PRMT"] + ops["LOP3"] + ops["SHF"] < 0.55 * codes_per_thread, ops
        steps[sum_by_mma] = sum(ops.values())
    assert steps[True] < steps[False], steps
