"""FP8 KV pages: every kernel that writes or reads them against a float32 oracle over the
dequantized caches (the interpreter on a CPU, the GPU when there is one), at odd lengths, on page
boundaries, with GQA, cached prefixes and several pages; the CPU paths against the same oracle."""
from __future__ import annotations

import pytest
import torch

from kernels import decode_attention, decode_reference, prefill_attention, prefill_attention_ref, store_kv, store_kv_ref
from kernels.attention import cpu
from kernels.attention.fdpp import new_stats
from kernels.attention.flash_decoding import decode_config
from kernels.attention.kv_quant import dequantize_kv, fp8_max, quantize_kv
from kernels.attention.prefix import (
    plan_prefix,
    prefix_attention_cudnn,
    prefix_attention_ref,
    prefix_seed,
    prefix_spans,
)
from kernels.attention.tma import has_tma
from kernels.vendor import DecodeConfig, PrefillConfig, vendor_configs
from tests.support.paged_cache import shuffled_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = DecodeConfig(block_n=32, min_chunk=64, num_stages=1)
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# The fnuz formats are AMD's: NVIDIA GPUs have no conversion for them (the interpreter and ROCm do).
FNUZ = [] if torch.cuda.is_available() and not torch.version.hip else [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def fp8_batch(lens, num_heads, num_kv_heads, head_dim, page, kv_dtype, q_dtype=torch.bfloat16, seed=0):
    """q, FP8 caches (codes of random K/V whose heads differ in magnitude, with their per-head scales;
    shuffled tables, spare pages of other codes) and the float32 dequantized caches."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [(n + page - 1) // page for n in lens]
    num_blocks = sum(pages_per_seq) + 3
    magnitude = torch.rand(num_kv_heads, generator=gen) * 8 + 0.5     # per head: 0.5 .. 8.5
    caches, scales = [], []
    for _ in range(2):
        values = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen) * magnitude[:, None]
        scale = values.abs().amax(dim=(0, 1, 3)) / fp8_max(kv_dtype)
        caches.append(quantize_kv(values, scale, kv_dtype))
        scales.append(scale)
    tables = shuffled_tables(pages_per_seq, num_blocks, gen)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(q_dtype)
    k, v = caches
    k_scale, v_scale = scales
    exact_k, exact_v = dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)
    to = [t.to(DEVICE) for t in (q, k, v, tables, torch.tensor(lens, dtype=torch.int32), k_scale, v_scale,
                                 exact_k, exact_v)]
    return to


def test_quantize_saturates_and_rounds_to_nearest():
    for dtype in (*FP8, torch.float8_e4m3fnuz):
        limit = fp8_max(dtype)
        x = torch.tensor([[[1e9, -1e9, float("inf"), 3.3, -0.07, 0.0]]])
        codes = quantize_kv(x, torch.tensor([2.0]), dtype)
        back = dequantize_kv(codes, torch.tensor([2.0]))
        assert torch.isfinite(back).all(), dtype
        assert back[0, 0, :3].tolist() == [2 * limit, -2 * limit, 2 * limit]
        # round to nearest: within half a step of the format (3 or 2 mantissa bits)
        step = 2.0 ** -(3 if "e4m3" in str(dtype) else 2)
        assert torch.allclose(back[0, 0, 3:], x[0, 0, 3:], rtol=step / 2, atol=1e-6), (dtype, back)


@pytest.mark.parametrize("kv_dtype", FP8)
def test_store_kv_writes_the_reference_codes(kv_dtype):
    _, k, v, _, _, k_scale, v_scale, _, _ = fp8_batch([64], 2, 3, 64, 16, kv_dtype, seed=1)
    qkv = torch.randn(7, 3, 3, 64, device=k.device).to(torch.bfloat16) * 40   # some values saturate
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([3, -1, 17, 40, 41, -1, 63], device=k.device)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    store_kv(key, value, k1, v1, slots, k_scale=k_scale, v_scale=v_scale)
    store_kv_ref(key, value, k2, v2, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(k1.float(), k2.float()) and torch.equal(v1.float(), v2.float())   # -0 and +0 alike
    assert not torch.equal(k1.float(), k.float())   # something was written
    assert torch.isfinite(k1.float()).all() and torch.isfinite(v1.float()).all()


# (lens, Hq, Hkv, D, page): odd lengths, page boundaries +-1, L = 1, GQA 1/3/4, D 64/128, several splits.
CASES = [
    ([1, 16, 17, 47], 2, 2, 64, 16),
    ([63, 64, 65, 200], 6, 2, 64, 32),
    ([300, 5], 4, 1, 128, 16),
]


@pytest.mark.parametrize("variant", ["standard", "flash", "fdpp"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("kv_dtype", [*FP8, *FNUZ])
def test_decode_reads_fp8_pages(variant, case, kv_dtype):
    lens, hq, hkv, d, page = CASES[case]
    q, k, v, tables, seq_lens, k_scale, v_scale, exact_k, exact_v = fp8_batch(lens, hq, hkv, d, page, kv_dtype,
                                                                              seed=case)
    options = {"stats": new_stats(q.device)} if variant == "fdpp" else {}
    out = decode_attention(q, k, v, tables, seq_lens, scale=d ** -0.5, variant=variant, num_splits=4, config=SMALL,
                           k_scale=k_scale, v_scale=v_scale, **options)
    oracle = decode_reference(q.float(), exact_k, exact_v, tables, seq_lens, scale=d ** -0.5, variant="standard")
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert rel_err(out, oracle) < TOL
    ref_options = {"stats": new_stats(q.device), "block_n": SMALL.block_n, "min_chunk": SMALL.min_chunk} \
        if variant == "fdpp" else {}
    ref = decode_reference(q, k, v, tables, seq_lens, scale=d ** -0.5, variant=variant, num_splits=4,
                           k_scale=k_scale, v_scale=v_scale, **ref_options)
    assert rel_err(ref, oracle) < TOL
    if variant == "fdpp":   # P·V in bf16: FD++'s window is as wide as over bf16 pages
        assert int(options["stats"][0]) == int(ref_options["stats"][0]) == 0


# AMD's launch options run on AMD GPUs or in the interpreter, NVIDIA's on NVIDIA GPUs or in the interpreter.
LAUNCH_VENDORS = ["nvidia", "amd"] if not torch.cuda.is_available() else ["amd" if torch.version.hip else "nvidia"]


@pytest.mark.parametrize("vendor", LAUNCH_VENDORS)
def test_fp8_pages_take_their_launch_shape(vendor):
    """`decode_for` picks the FP8 shape for 1-byte pages only; the wave heuristic's split count under
    that shape (no forced num_splits) still equals the oracle at odd lengths across pages."""
    configs = vendor_configs(vendor)
    assert configs.decode_for(torch.bfloat16) is configs.decode
    fp8_config = configs.decode_for(torch.float8_e4m3fn)
    assert fp8_config is (configs.decode_fp8 or configs.decode)
    q, k, v, tables, seq_lens, k_scale, v_scale, exact_k, exact_v = fp8_batch([301, 47, 16], 8, 2, 64, 16,
                                                                              torch.float8_e4m3fn, seed=5)
    out = decode_attention(q, k, v, tables, seq_lens, scale=0.125, variant="flash", config=fp8_config,
                           k_scale=k_scale, v_scale=v_scale)
    oracle = decode_reference(q.float(), exact_k, exact_v, tables, seq_lens, scale=0.125, variant="standard")
    assert rel_err(out, oracle) < TOL


@pytest.mark.parametrize("page", [16, 32, 8])
@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_pages_through_tma_copies(page, kv_dtype):
    """NVIDIA's FP8 shape for GPUs with TMA copies: whole tiles by TMA, the last partial tile by masked loads
    (lengths that end inside a tile, on a page boundary, inside the first tile); pages of 8 cannot hold its
    16-token tiles, so `decode_config` falls back to the pointer-load shape."""
    configs = vendor_configs("nvidia")
    tma_shape = configs.decode_fp8_tma
    assert tma_shape is not None and tma_shape.tma
    chosen = decode_config(configs, torch.device(DEVICE), kv_dtype, page)
    fits = page % tma_shape.block_n == 0 and has_tma(torch.device(DEVICE))
    assert chosen is (tma_shape if fits else configs.decode_for(kv_dtype))
    # one split a sequence (standard) keeps the shared shape: one one-warp program per KV head would crawl
    assert decode_config(configs, torch.device(DEVICE), kv_dtype, page, one_split=True) is configs.decode
    q, k, v, tables, seq_lens, k_scale, v_scale, exact_k, exact_v = fp8_batch([301, 47, 32, 5], 8, 2, 64, page,
                                                                              kv_dtype, seed=7)
    oracle = decode_reference(q.float(), exact_k, exact_v, tables, seq_lens, scale=0.125, variant="standard")
    for splits in (1, 3):
        out = decode_attention(q, k, v, tables, seq_lens, scale=0.125, variant="flash", config=chosen,
                               num_splits=splits, k_scale=k_scale, v_scale=v_scale)
        assert rel_err(out, oracle) < TOL


# The vendor config over pages of 16, and TMA loads of 16-key tiles from pages of 32.
PREFILL_LOADS = {"pointer": (16, None),
                 "tma": (32, PrefillConfig(block_m=32, block_n=16, num_stages=1, pack=4, tma=True))}


@pytest.mark.parametrize("loads", list(PREFILL_LOADS))
@pytest.mark.parametrize("kv_dtype", [*FP8, *FNUZ])
def test_prefill_reads_fp8_pages(kv_dtype, loads):
    """Seq 0: a chunk after a cached prefix of several pages; seq 1: a first turn; seq 2: one row
    after a one-page prefix."""
    page, config = PREFILL_LOADS[loads]
    if config is not None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    lens, q_lens = [100, 40, 17], [37, 40, 1]
    _, k, v, tables, seq_lens, k_scale, v_scale, exact_k, exact_v = fp8_batch(lens, 8, 2, 64, page, kv_dtype, seed=5)
    qsl = torch.tensor([0, 37, 77, 78], dtype=torch.int32, device=k.device)
    q = torch.randn(sum(q_lens), 8, 64, device=k.device).to(torch.bfloat16)
    out = prefill_attention(q, k, v, tables, seq_lens, qsl, scale=0.125, k_scale=k_scale, v_scale=v_scale,
                            config=config)
    oracle = prefill_attention_ref(q.float(), exact_k, exact_v, tables, seq_lens, qsl, scale=0.125)
    assert rel_err(out, oracle) < TOL
    ref = prefill_attention_ref(q, k, v, tables, seq_lens, qsl, scale=0.125, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(ref, oracle) < TOL


@pytest.mark.parametrize("kv_dtype", FP8)
def test_cpu_paths_read_and_write_fp8_pages(kv_dtype):
    """The CPU's fused paths: in-place runs (batch 1, and a table in more runs than it reads in
    place), the gathered short batch, SDPA prefill over a cached prefix; the store's codes."""
    lens = [17, 65, 33]
    q, k, v, tables, seq_lens, k_scale, v_scale, exact_k, exact_v = [
        t.cpu() for t in fp8_batch(lens, 6, 3, 64, 16, kv_dtype, q_dtype=torch.float32, seed=7)]
    oracle = decode_reference(q, exact_k, exact_v, tables, seq_lens, scale=0.125, variant="standard")
    gathered = cpu.decode_attention_cpu(q, k, v, tables, seq_lens, scale=0.125, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(gathered, oracle) < 1e-5      # float32 queries: only the summation order differs
    one = cpu.decode_attention_cpu(q[1:2], k, v, tables[1:2], seq_lens[1:2], scale=0.125, k_scale=k_scale,
                                   v_scale=v_scale)
    assert rel_err(one, oracle[1:2]) < 1e-5
    qsl = torch.tensor([0, 5, 45, 78], dtype=torch.int32)
    qp = torch.randn(78, 6, 64)
    out = cpu.prefill_attention_cpu(qp, k, v, tables, seq_lens, qsl, scale=0.125, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(out, prefill_attention_ref(qp, exact_k, exact_v, tables, seq_lens, qsl, scale=0.125)) < 1e-5
    key, value = torch.randn(2, 4, 3, 64) * 3
    slots = torch.tensor([0, 9, 30, 47])
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    cpu.store_kv_cpu(key, value, k1, v1, slots, k_scale=k_scale, v_scale=v_scale)
    store_kv_ref(key, value, k2, v2, slots, k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(k1.view(torch.uint8), k2.view(torch.uint8))
    assert torch.equal(v1.view(torch.uint8), v2.view(torch.uint8))


def test_fp8_pages_need_their_scales():
    q, k, v, tables, seq_lens, k_scale, v_scale, _, _ = fp8_batch([20], 2, 2, 64, 16, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale per KV head"):
        decode_attention(q, k, v, tables, seq_lens, scale=0.125, variant="flash", config=SMALL)
    with pytest.raises(ValueError, match="scale per KV head"):
        store_kv_ref(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), k.cpu(), v.cpu(), torch.tensor([0]))
    with pytest.raises(ValueError, match="FP8 cache only"):
        store_kv_ref(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), k.float().cpu(), v.float().cpu(),
                     torch.tensor([0]), k_scale=k_scale.cpu(), v_scale=v_scale.cpu())


@pytest.mark.parametrize("kv_dtype", [*FP8, *FNUZ])
def test_store_rounds_every_value_like_torch(kv_dtype):
    """Every float32 of a dense sweep (ties, subnormals, the saturation edge) stores torch's value
    (a tiny negative may become +0 where torch writes -0: the same value, and fnuz has no -0)."""
    limit, tiny = fp8_max(kv_dtype), torch.finfo(kv_dtype).tiny
    values = torch.cat([torch.linspace(-1.2 * limit, 1.2 * limit, 4001), torch.linspace(-4 * tiny, 4 * tiny, 999)])
    values = torch.cat([values, torch.zeros(-values.numel() % 320)])
    rows = values.view(-1, 5, 64)                          # [T, Hkv, D]
    scale, slots = torch.ones(5), torch.arange(rows.shape[0])
    ref_k, ref_v = (torch.zeros(rows.shape[0], 1, 5, 64, dtype=kv_dtype) for _ in range(2))
    store_kv_ref(rows, rows, ref_k, ref_v, slots, k_scale=scale, v_scale=scale)
    k, v = ref_k.to(DEVICE).zero_(), ref_v.to(DEVICE).zero_()
    store_kv(rows.to(DEVICE), rows.to(DEVICE), k, v, slots.to(DEVICE), k_scale=scale.to(DEVICE),
             v_scale=scale.to(DEVICE))
    assert torch.equal(k.cpu().float(), ref_k.float())


SEEDED = PrefillConfig(block_m=32, block_n=16, num_stages=1, pack=4)


@pytest.mark.parametrize("kv_dtype", [*FP8, *FNUZ])
def test_prefill_seeded_by_the_prefix_over_fp8_pages(kv_dtype):
    """Seq 0's cached prefix is attended outside the kernel over the dequantized pages (cuDNN on a GPU of
    compute capability 9.0+, the float32 reference elsewhere) and the kernel folds in the rest from that
    state; seq 1 (a first turn) and seq 2 (one row after a page) have no span."""
    lens, q_lens = [100, 40, 17], [37, 40, 1]
    _, k, v, tables, seq_lens, k_scale, v_scale, exact_k, exact_v = fp8_batch(lens, 8, 2, 64, 16, kv_dtype, seed=7)
    qsl = torch.tensor([0, 37, 77, 78], dtype=torch.int32, device=k.device)
    q = (torch.randn(sum(q_lens), 8, 64, device=k.device) * 2).to(torch.bfloat16)
    spans = prefix_spans(lens, qsl.tolist(), min_keys=32, min_rows=2, align=SEEDED.block_n)
    assert [(s.seq, s.key_start) for s in spans] == [(0, 48)]
    hopper = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9
    seed = prefix_seed(q, k, v, tables, plan_prefix(spans, 3, q.device), 0.125,
                       attend=prefix_attention_cudnn if hopper else prefix_attention_ref, k_scale=k_scale)
    out = prefill_attention(q, k, v, tables, seq_lens, qsl, scale=0.125, k_scale=k_scale, v_scale=v_scale,
                            config=SEEDED, seed=seed)
    oracle = prefill_attention_ref(q.float(), exact_k, exact_v, tables, seq_lens, qsl, scale=0.125)
    assert rel_err(out, oracle) < TOL
    unseeded = prefill_attention(q, k, v, tables, seq_lens, qsl, scale=0.125, k_scale=k_scale, v_scale=v_scale,
                                 config=SEEDED)
    assert rel_err(out, unseeded) < TOL


def test_a_prefix_seed_over_fp8_pages_needs_k_scale():
    _, k, v, tables, _, _, _, _, _ = fp8_batch([100], 8, 2, 64, 16, torch.float8_e4m3fn, seed=8)
    q = torch.randn(37, 8, 64, device=k.device).to(torch.bfloat16)
    plan = plan_prefix(prefix_spans([100], [0, 37], min_keys=32, min_rows=2, align=16), 1, q.device)
    with pytest.raises(ValueError, match="k_scale"):
        prefix_seed(q, k, v, tables, plan, 0.125, attend=prefix_attention_ref)
