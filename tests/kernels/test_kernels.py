"""Triton kernels against their torch references.

Without a GPU these run under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; the
interpreter neither enforces `tl.dot` minimum sizes nor bounds, so the GPU shapes and speed are
checked by `bench/kernels.py` on the device (and the `gpu` tests below when CUDA is present).
"""
from __future__ import annotations

import pytest
import torch

from kernels import (
    check_vendor,
    choose_num_splits,
    decode_attention,
    decode_reference,
    detect_vendor,
    new_stats,
    plan_decode,
    prefill_attention,
    prefill_attention_ref,
    run_decode,
    store_kv,
    store_kv_ref,
)
from kernels.attention.reference import split_plan
from kernels.vendor import DecodeConfig, vendor_configs
from tests.support.paged_cache import shuffled_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 is exact in the interpreter; on a GPU tl.dot runs float32 as tf32 (~1e-3 relative).
TOL32 = 1e-5 if DEVICE == "cpu" else 5e-3
# Interpreter-sized tiles: 32-token KV tiles and 64-token minimum splits so that a few hundred
# tokens already give several splits, a partial last tile and a page-boundary split edge.
SMALL = DecodeConfig(block_n=32, min_chunk=64, num_stages=1)
REF_SPLIT = dict(block_n=SMALL.block_n, min_chunk=SMALL.min_chunk)


def paged_batch(lens, num_heads, num_kv_heads, head_dim, page, dtype=torch.float32, seed=0):
    """Random q and caches with shuffled (non-monotonic) block tables and spare garbage pages."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [(n + page - 1) // page for n in lens]
    num_blocks = sum(pages_per_seq) + 3
    k_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables = shuffled_tables(pages_per_seq, num_blocks, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, seq_lens)]


def rel_err(out, ref):
    return float((out.float() - ref.float()).norm() / ref.float().norm())


# (lens, Hq, Hkv, D, page, dtype): GQA 1/3/4/8/20, odd lengths, lengths on page boundaries,
# L = 1, mixed lengths in one batch, pages smaller and larger than the KV tile, bf16 and fp16.
CASES = [
    ([1, 16, 17, 48], 2, 2, 64, 16, torch.float32),
    ([63, 64, 65, 200], 6, 2, 64, 32, torch.float32),
    ([300, 5], 4, 1, 64, 64, torch.bfloat16),
    ([129, 7, 256], 8, 1, 64, 16, torch.float16),
    ([77, 128], 20, 1, 32, 16, torch.float32),
    ([150], 4, 2, 128, 32, torch.bfloat16),
    ([40], 2, 1, 256, 16, torch.float32),
]


@pytest.mark.parametrize("variant", ["standard", "flash", "fdpp"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_decode_matches_reference(variant, case):
    lens, hq, hkv, d, page, dtype = CASES[case]
    q, k, v, tables, seq_lens = paged_batch(lens, hq, hkv, d, page, dtype, seed=case)
    scale = d ** -0.5
    options = {"stats": new_stats(q.device)} if variant == "fdpp" else {}
    out = decode_attention(q, k, v, tables, seq_lens, scale=scale, variant=variant, num_splits=4,
                           config=SMALL, **options)
    exact = decode_reference(q, k, v, tables, seq_lens, scale=scale, variant="standard")
    same_algo = decode_reference(q, k, v, tables, seq_lens, scale=scale, variant=variant, num_splits=4,
                                 **({} if variant == "standard" else REF_SPLIT))
    tol = TOL32 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, exact) < tol
    assert rel_err(same_algo, exact) < tol
    if variant == "fdpp":
        assert int(options["stats"][0]) == 0


@pytest.mark.parametrize("variant", ["flash", "fdpp"])
def test_decode_with_register_prefetch(variant):
    """The loop that prefetches the next tile in registers computes the same thing."""
    q, k, v, tables, seq_lens = paged_batch([130, 64, 3], 8, 2, 64, 16, torch.float32, seed=17)
    out = decode_attention(q, k, v, tables, seq_lens, scale=0.125, variant=variant, num_splits=3,
                           config=DecodeConfig(block_n=32, min_chunk=64, num_stages=1, prefetch=True))
    ref = decode_reference(q, k, v, tables, seq_lens, scale=0.125, variant="standard")
    assert rel_err(out, ref) < TOL32


@pytest.mark.parametrize("variant", ["flash", "fdpp"])
@pytest.mark.parametrize("page", [16, 64])
def test_decode_with_page_windows(variant, page):
    """Page ids held in registers per window of 4 pages (several windows per split)."""
    q, k, v, tables, seq_lens = paged_batch([300, 130, 5], 8, 2, 64, page, torch.float32, seed=19)
    out = decode_attention(q, k, v, tables, seq_lens, scale=0.125, variant=variant, num_splits=2,
                           config=DecodeConfig(block_n=32, min_chunk=64, num_stages=1, page_window=4))
    ref = decode_reference(q, k, v, tables, seq_lens, scale=0.125, variant="standard")
    assert rel_err(out, ref) < TOL32


@pytest.mark.parametrize("variant, num_splits", [("standard", None), ("flash", 3), ("flash", None), ("fdpp", 3)])
def test_one_plan_serves_two_layers(variant, num_splits):
    """`plan_decode` once, `run_decode` on two layers' caches (fresh random data, odd lengths and
    lengths on page boundaries): each layer equals `decode_attention` on it bit for bit (interpreter)
    and the torch reference; the plan's workspaces are shared by the layers."""
    lens, hq, hkv, d, page = [1, 31, 32, 33, 97], 4, 2, 32, 16
    layers = [paged_batch(lens, hq, hkv, d, page, seed=40 + i) for i in range(2)]
    q, k, _, tables, _ = layers[0]
    plan = plan_decode(len(lens), hq, hkv, d, page, tables.shape[1], dtype=q.dtype, device=q.device,
                       variant=variant, num_splits=num_splits, config=SMALL)
    for q, k, v, tables, seq_lens in layers:
        extra = {"stats": new_stats(q.device)} if variant == "fdpp" else {}
        out = run_decode(plan, q, k, v, tables, seq_lens, scale=d ** -0.5, **extra)
        alone = decode_attention(q, k, v, tables, seq_lens, scale=d ** -0.5, variant=variant, num_splits=num_splits,
                                 config=SMALL, **({"stats": new_stats(q.device)} if variant == "fdpp" else {}))
        ref = decode_reference(q, k, v, tables, seq_lens, scale=d ** -0.5, variant="standard")
        assert torch.equal(out, alone) if DEVICE == "cpu" else rel_err(out, alone) < TOL32
        assert rel_err(out, ref) < TOL32
        if variant == "fdpp":
            assert int(extra["stats"][0]) == 0


def test_a_plan_refuses_other_shapes_and_options():
    q, k, v, tables, seq_lens = paged_batch([40, 9], 4, 2, 32, 16, seed=44)
    flash = plan_decode(2, 4, 2, 32, 16, tables.shape[1], dtype=q.dtype, device=q.device, variant="flash",
                        num_splits=2, config=SMALL)
    with pytest.raises(ValueError, match="do not match"):
        run_decode(flash, q[:1], k, v, tables[:1], seq_lens[:1], scale=0.125)
    with pytest.raises(ValueError, match="fdpp plan only"):
        run_decode(flash, q, k, v, tables, seq_lens, scale=0.125, phi=1.0)
    fdpp = plan_decode(2, 4, 2, 32, 16, tables.shape[1], dtype=q.dtype, device=q.device, variant="fdpp",
                       num_splits=2, config=SMALL)
    with pytest.raises(ValueError, match="estimates"):
        run_decode(fdpp, q, k, v, tables, seq_lens, scale=0.125, phi=1.0)


def test_split_plan_covers_every_token_once():
    lens = torch.tensor([1, 63, 64, 65, 1000, 4096, 131072], dtype=torch.int32)
    chunk, n = split_plan(lens, max_splits=29, block_n=64, min_chunk=256)
    assert torch.all(chunk % 64 == 0) and torch.all(chunk >= 256)
    assert torch.all((n - 1) * chunk < lens.clamp(min=1)) and torch.all(n * chunk >= lens)
    assert int(n[-1]) <= 29 and int(n[0]) == 1


def test_wave_heuristic_fills_the_gpu_at_batch_one():
    assert choose_num_splits(1, 8, 132, ctas_per_sm=2) == 29     # 232 CTAs on 132 SMs x 2
    assert choose_num_splits(1, 8, 132, ctas_per_sm=3) == 42     # 336 CTAs on 132 SMs x 3
    assert choose_num_splits(8, 8, 132, ctas_per_sm=2) == 4
    assert choose_num_splits(32, 8, 132, ctas_per_sm=2) == 1      # the batch alone fills the GPU


def test_fdpp_workspace_is_left_zeroed_between_launches():
    q, k, v, tables, seq_lens = paged_batch([200, 90], 4, 2, 64, 16, seed=11)
    for seed in (1, 2):
        q = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).to(q)
        out = decode_attention(q, k, v, tables, seq_lens, scale=0.125, variant="fdpp", num_splits=4,
                               config=SMALL, phi=1.0)
        ref = decode_reference(q, k, v, tables, seq_lens, scale=0.125, variant="standard")
        assert rel_err(out, ref) < TOL32


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the interpreter's numpy sees the overflow
@pytest.mark.parametrize("fallback", [True, False])
def test_fdpp_forced_phi_out_of_window(fallback):
    """φ far below every score: each row overflows; exact with fallback, counted either way."""
    q, k, v, tables, seq_lens = paged_batch([100, 257, 31], 8, 2, 64, 16, seed=3)
    stats, ref_stats = new_stats(q.device), new_stats(q.device)
    out = decode_attention(q, k, v, tables, seq_lens, scale=0.125, variant="fdpp", num_splits=4,
                           config=SMALL, phi=-200.0, fallback=fallback, stats=stats)
    decode_reference(q, k, v, tables, seq_lens, scale=0.125, variant="fdpp", num_splits=4,
                     phi=-200.0, fallback=fallback, stats=ref_stats, **REF_SPLIT)
    assert int(stats[0]) == int(ref_stats[0]) == 3 * 8
    if fallback:
        ref = decode_reference(q, k, v, tables, seq_lens, scale=0.125, variant="standard")
        assert rel_err(out, ref) < TOL32


@pytest.mark.parametrize("fallback", [True, False])
def test_fdpp_estimated_phi_spike_is_caught(fallback):
    """A mid-sequence key far above the sink/window estimate flags exactly its row."""
    q, k, v, tables, seq_lens = paged_batch([180, 150], 2, 2, 64, 16, seed=5)
    pos, seq, head = 90, 0, 1
    page = int(tables[seq, pos // 16])
    k[page, pos % 16, head] = q[seq, head] * (60.0 / float(q[seq, head].norm() ** 2 * 0.125))  # score 60
    stats, ref_stats = new_stats(q.device), new_stats(q.device)
    out = decode_attention(q, k, v, tables, seq_lens, scale=0.125, variant="fdpp", num_splits=4,
                           config=SMALL, fallback=fallback, stats=stats)
    decode_reference(q, k, v, tables, seq_lens, scale=0.125, variant="fdpp", num_splits=4,
                     fallback=fallback, stats=ref_stats, **REF_SPLIT)
    assert int(stats[0]) == int(ref_stats[0]) == 1
    ref = decode_reference(q, k, v, tables, seq_lens, scale=0.125, variant="standard")
    if fallback:
        assert rel_err(out, ref) < TOL32
    else:   # the other rows are untouched by the bad one
        assert rel_err(out[1], ref[1]) < TOL32


@pytest.mark.skipif(torch.cuda.is_available() and not torch.version.hip,
                    reason="AMD launch options run on AMD GPUs or in the interpreter")
def test_amd_configs_run():
    amd = vendor_configs("amd")
    q, k, v, tables, seq_lens = paged_batch([70, 33], 4, 1, 64, 16, seed=7)
    out = decode_attention(q, k, v, tables, seq_lens, scale=0.125, variant="flash", num_splits=2,
                           config=amd.decode)
    ref = decode_reference(q, k, v, tables, seq_lens, scale=0.125, variant="standard")
    assert rel_err(out, ref) < TOL32
    qp = torch.randn(20, 4, 64).to(q)
    qsl = torch.tensor([0, 12, 20], dtype=torch.int32, device=q.device)
    out = prefill_attention(qp, k, v, tables, seq_lens, qsl, scale=0.125, config=amd.prefill)
    assert rel_err(out, prefill_attention_ref(qp, k, v, tables, seq_lens, qsl, scale=0.125)) < TOL32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_skips_padding_slots(dtype):
    _, k, v, _, _ = paged_batch([64], 2, 2, 64, 16, dtype, seed=9)
    qkv = torch.randn(6, 3, 2, 64).to(k)            # key/value as strided views of a fused output
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([3, -1, 17, 40, 41, -1], device=k.device)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    store_kv(key, value, k1, v1, slots)
    store_kv_ref(key, value, k2, v2, slots)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_and_prefix_hits(dtype):
    """Seq 0: chunk after a cached prefix; seq 1: first turn; seq 2: a decode row in the batch."""
    lens = [100, 40, 67]
    q_lens = [37, 40, 1]
    _, k, v, tables, seq_lens = paged_batch(lens, 8, 2, 64, 16, dtype, seed=13)
    qsl = torch.tensor([0, 37, 77, 78], dtype=torch.int32, device=k.device)
    q = torch.randn(sum(q_lens), 8, 64).to(k)
    out = prefill_attention(q, k, v, tables, seq_lens, qsl, scale=0.125)
    ref = prefill_attention_ref(q, k, v, tables, seq_lens, qsl, scale=0.125)
    assert rel_err(out, ref) < (TOL32 if dtype == torch.float32 else 1e-2)


def test_vendor_checks():
    found = detect_vendor()
    assert check_vendor("auto") == found and check_vendor("cpu") == "cpu"
    with pytest.raises(ValueError, match="gpu_vendor"):
        check_vendor("intel")
    other = "amd" if found == "nvidia" else "nvidia"
    with pytest.raises(ValueError, match="contradicts the hardware"):
        check_vendor(other)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("variant", ["standard", "flash", "fdpp"])
def test_gpu_llama_shape(variant):
    """Llama-3.1-8B heads (32/8, D=128, bf16) at 4K mixed lengths vs the fp32 reference."""
    q, k, v, tables, seq_lens = paged_batch([4096, 1000, 2049, 17], 32, 8, 128, 16, torch.bfloat16, seed=21)
    out = decode_attention(q, k, v, tables, seq_lens, scale=128 ** -0.5, variant=variant)
    ref = decode_reference(q, k, v, tables, seq_lens, scale=128 ** -0.5, variant="standard")
    assert rel_err(out, ref) < 1e-2
