"""The CPU attention (`kernels.attention.cpu`) against a float64 oracle written token by token and
against the paged torch references: odd lengths, page boundaries, GQA 1/3/4, cached prefixes,
bf16, and stale pages full of NaN (a padded row must never read them)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import cpu
from kernels.attention.cpu import (
    PageRun,
    decode_attention_cpu,
    page_runs,
    prefill_attention_cpu,
    slot_has_padding,
    store_kv_cpu,
)
from kernels.attention.reference import decode_attention_ref, prefill_attention_ref, store_kv_ref


def paged(lens: list[int], num_kv_heads: int, head_dim: int, page: int, dtype: torch.dtype, seed: int,
          in_order: bool = False):
    """Random caches whose pages are shuffled (or handed out in order, as a fresh block manager does);
    every slot that no sequence owns holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [(n + page - 1) // page for n in lens]
    num_blocks = sum(pages_per_seq) + 2
    k_cache = torch.full((num_blocks, page, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.arange(1, num_blocks + 1) if in_order else torch.randperm(num_blocks, generator=gen)
    num_blocks += 1 if in_order else 0
    k_cache = torch.full((num_blocks, page, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables = torch.zeros(len(lens), max(pages_per_seq) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(lens):
        for p in range(pages_per_seq[b]):
            block = int(perm[used + p])
            tables[b, p] = block
            rows = min(page, n - p * page)
            k_cache[block, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[block, :rows] = torch.randn(rows, num_kv_heads, head_dim, generator=gen).to(dtype)
        used += pages_per_seq[b]
    return k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), gen


def oracle(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, length: int,
           q_positions: list[int], scale: float) -> torch.Tensor:
    """Float64 attention of q[Tq, Hq, D] (at q_positions) over the first `length` tokens, slot by slot."""
    page = k_cache.shape[1]
    slots = [(int(table[p // page]), p % page) for p in range(length)]
    k = torch.stack([k_cache[b, r] for b, r in slots]).double()      # [L, Hkv, D]
    v = torch.stack([v_cache[b, r] for b, r in slots]).double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    visible = torch.arange(length)[None, :] <= torch.tensor(q_positions)[:, None]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


# (lens, Hq, Hkv, D, page): one token, page boundaries +-1, odd lengths, GQA 1 / 3 / 4.
DECODE_CASES = [
    ([1, 16, 17, 15], 4, 4, 64, 16),
    ([63, 64, 65, 200], 9, 3, 64, 32),
    ([301, 5], 8, 2, 32, 16),
    ([129], 6, 2, 128, 64),
]
FLOAT32_TOL, BF16_TOL = 1e-5, 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", DECODE_CASES)
def test_decode_matches_float64_and_the_reference(case, dtype):
    lens, num_heads, num_kv_heads, head_dim, page = case
    k_cache, v_cache, tables, seq_lens, gen = paged(lens, num_kv_heads, head_dim, page, dtype, seed=len(lens))
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens, scale=scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    exact = torch.cat([oracle(q[b:b + 1], k_cache, v_cache, tables[b], n, [n - 1], scale) for b, n in enumerate(lens)])
    tol = FLOAT32_TOL if dtype == torch.float32 else BF16_TOL
    err = rel_err(out, exact)
    assert err < tol, f"rel. error {err:.2e} against float64"
    ref = decode_attention_ref(q, k_cache, v_cache, tables, seq_lens, scale=scale)
    assert rel_err(out, ref) < tol


# Past GATHER_MAX_LEN each sequence reads its pages in place: one run, a few runs, more runs than
# MAX_PAGE_RUNS (gathered); past KV_SPLIT_MIN_LEN a piece is cut into 2 and KV_SPLITS chunks plus a rest.
LONG_LENS = [cpu.KV_SPLITS * cpu.KV_SPLIT_MIN_CHUNK + 37, cpu.KV_SPLIT_MIN_LEN + 37, cpu.GATHER_MAX_LEN + 1, 3]


@pytest.mark.parametrize("length", [cpu.KV_SPLIT_MIN_LEN, cpu.KV_SPLIT_MIN_LEN + 1, 3 * cpu.KV_SPLIT_MIN_CHUNK,
                                    cpu.KV_SPLITS * cpu.KV_SPLIT_MIN_CHUNK + 37, 20_000])
def test_kv_chunks_cover_every_token_once_in_order(length):
    kv = torch.randn(length, 3, 8)
    chunks = cpu._chunks(kv)
    splits = chunks[0].shape[0]
    expected = 1 if length <= cpu.KV_SPLIT_MIN_LEN else min(cpu.KV_SPLITS, length // cpu.KV_SPLIT_MIN_CHUNK)
    assert splits == expected and len(chunks) == (1 if length % splits == 0 else 2)
    rows = torch.cat([c.transpose(1, 2).reshape(-1, 3, 8) for c in chunks])
    assert torch.equal(rows, kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_order", [True, False])
def test_long_decode_reads_pages_in_place(in_order, dtype):
    k_cache, v_cache, tables, seq_lens, gen = paged(LONG_LENS, 2, 64, 16, dtype, seed=7, in_order=in_order)
    runs = page_runs(tables, seq_lens, 16)
    if in_order:
        assert [len(r) for r in runs] == [1] * len(LONG_LENS)
    else:
        assert all(len(r) > cpu.MAX_PAGE_RUNS for r in runs[:2])
    q = torch.randn(len(LONG_LENS), 6, 64, generator=gen).to(dtype)
    out = decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    exact = torch.cat([oracle(q[b:b + 1], k_cache, v_cache, tables[b], n, [n - 1], 0.125)
                       for b, n in enumerate(LONG_LENS)])
    err = rel_err(out, exact)
    assert err < (FLOAT32_TOL if dtype == torch.float32 else BF16_TOL), f"rel. error {err:.2e}"


def test_page_runs_split_where_block_ids_jump():
    tables = torch.tensor([[4, 5, 6, 9, 10, 2, 0], [7, 0, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([16 * 5 + 3, 16, 0], dtype=torch.int32)
    assert page_runs(tables, seq_lens, 16) == [
        [PageRun(4, 3, 48), PageRun(9, 2, 32), PageRun(2, 1, 3)], [PageRun(7, 1, 16)], []]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_few_runs_in_place_and_an_empty_sequence(dtype):
    """Each run through SDPA, the runs merged by their log-sum-exps."""
    k_cache, v_cache, tables, _, gen = paged([1500], 3, 32, 16, dtype, seed=2, in_order=True)
    tables[0, 30:36] = tables[0, 30:36].flip(0)          # 8 runs: 30 pages, six single pages, the rest
    tables = torch.cat([tables, torch.zeros_like(tables)])
    seq_lens = torch.tensor([1500, 0], dtype=torch.int32)
    runs = page_runs(tables, seq_lens, 16)
    assert len(runs[0]) == 8 <= cpu.MAX_PAGE_RUNS and runs[1] == []
    q = torch.randn(2, 6, 32, generator=gen).to(dtype)
    out = decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens, scale=0.2)
    exact = oracle(q[:1], k_cache, v_cache, tables[0], 1500, [1499], 0.2)
    err = rel_err(out[:1], exact)
    assert err < (FLOAT32_TOL if dtype == torch.float32 else BF16_TOL), f"rel. error {err:.2e}"
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("lens", [[100], [100, 37], [cpu.GATHER_MAX_LEN + 5]])
def test_short_decode_runs_the_cpu_flash_kernel(lens):
    """A lone short sequence, a short batch (masked) and a sequence in place: SDPA's flash kernel."""
    from torch.profiler import profile

    k_cache, v_cache, tables, seq_lens, gen = paged(lens, 3, 64, 16, torch.bfloat16, seed=4, in_order=True)
    q = torch.randn(len(lens), 9, 64, generator=gen).to(torch.bfloat16)
    with profile() as prof:
        out = decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens, scale=0.125)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
    exact = torch.cat([oracle(q[b:b + 1], k_cache, v_cache, tables[b], n, [n - 1], 0.125) for b, n in enumerate(lens)])
    assert rel_err(out, exact) < BF16_TOL


def test_decode_in_float64_stays_float64():
    k_cache, v_cache, tables, seq_lens, gen = paged([33, 70], 2, 16, 16, torch.float64, seed=3)
    q = torch.randn(2, 4, 16, generator=gen, dtype=torch.float64)
    out = decode_attention_cpu(q, k_cache, v_cache, tables, seq_lens, scale=0.25)
    exact = torch.cat([oracle(q[b:b + 1], k_cache, v_cache, tables[b], n, [n - 1], 0.25)
                       for b, n in enumerate([33, 70])])
    assert out.dtype == torch.float64 and rel_err(out, exact) < 1e-12


# (context lens, new tokens per sequence, Hq, Hkv, D, page): a first turn, a chunk after a cached
# prefix of one and of many pages, prefixes ending mid-page, a decode row in a prefill batch.
PREFILL_CASES = [
    ([40], [40], 4, 4, 64, 16),
    ([100, 40, 67], [37, 40, 1], 9, 3, 64, 16),
    ([17, 161], [1, 129], 8, 2, 32, 16),
    ([257], [64], 6, 1, 128, 64),
    ([700, 45], [600, 45], 9, 3, 64, 16),     # a long chunk after a prefix: causal + unmasked, merged
    ([1100], [513], 4, 2, 64, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_matches_float64_and_the_reference(case, dtype):
    lens, q_lens, num_heads, num_kv_heads, head_dim, page = case
    k_cache, v_cache, tables, seq_lens, gen = paged(lens, num_kv_heads, head_dim, page, dtype, seed=sum(lens))
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    query_start_loc = torch.tensor(starts, dtype=torch.int32)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    out = prefill_attention_cpu(q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale=scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    exact = torch.cat([oracle(q[starts[b]:starts[b + 1]], k_cache, v_cache, tables[b], n, list(range(n - m, n)), scale)
                       for b, (n, m) in enumerate(zip(lens, q_lens, strict=True))])
    tol = FLOAT32_TOL if dtype == torch.float32 else BF16_TOL
    err = rel_err(out, exact)
    assert err < tol, f"rel. error {err:.2e} against float64"
    ref = prefill_attention_ref(q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale=scale)
    assert rel_err(out, ref) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_short_chunk_after_a_prefix_equals_the_whole_prompt_bit_for_bit(dtype):
    """A repeated request served from the prefix cache recomputes its last rows as the first one did."""
    k_cache, v_cache, tables, seq_lens, gen = paged([300], 3, 64, 16, dtype, seed=12)
    q = torch.randn(300, 9, 64, generator=gen).to(dtype)
    whole = prefill_attention_cpu(q, k_cache, v_cache, tables, seq_lens, torch.tensor([0, 300], dtype=torch.int32),
                                  scale=0.125)
    tail = prefill_attention_cpu(q[-11:], k_cache, v_cache, tables, seq_lens,
                                 torch.tensor([0, 11], dtype=torch.int32), scale=0.125)
    assert torch.equal(tail, whole[-11:])


def test_prefill_skips_sequences_without_new_tokens():
    k_cache, v_cache, tables, seq_lens, gen = paged([20, 30], 2, 16, 16, torch.float32, seed=5)
    q = torch.randn(30, 2, 16, generator=gen)
    query_start_loc = torch.tensor([0, 0, 30], dtype=torch.int32)
    out = prefill_attention_cpu(q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale=0.25)
    exact = oracle(q, k_cache, v_cache, tables[1], 30, list(range(30)), 0.25)
    assert rel_err(out, exact) < FLOAT32_TOL


@pytest.mark.parametrize("cached_prefix", [0, 40])
def test_prefill_runs_the_cpu_flash_kernel(cached_prefix):
    """The point of the fused path: SDPA's flash kernel, not its unfused math fallback."""
    from torch.profiler import profile

    k_cache, v_cache, tables, seq_lens, gen = paged([120], 2, 64, 16, torch.float32, seed=9)
    q = torch.randn(120 - cached_prefix, 6, 64, generator=gen)
    query_start_loc = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    with profile() as prof:
        prefill_attention_cpu(q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale=0.125)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops


@pytest.mark.parametrize("slots", [[5, 17, 16, 40], [5, -1, 16, -1], []])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_what_the_reference_writes(slots, dtype):
    gen = torch.Generator().manual_seed(len(slots))
    caches = [torch.randn(4, 16, 2, 8, generator=gen).to(dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    key, value = (torch.randn(len(slots), 2, 8, generator=gen) for _ in range(2))
    slot_mapping = torch.tensor(slots, dtype=torch.int32)
    told = [c.clone() for c in caches]   # the same store with the step's padding answer given, as the backend does
    store_kv_cpu(key, value, *caches, slot_mapping)
    store_kv_cpu(key, value, *told, slot_mapping, has_padding=slot_has_padding(slot_mapping))
    store_kv_ref(key, value, *expected, slot_mapping)
    assert all(torch.equal(a, b) for a, b in zip(caches, expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(told, expected, strict=True))
    assert slot_has_padding(slot_mapping) == (-1 in slots)
    if slots and slots[0] >= 0:
        assert torch.equal(caches[0].view(-1, 2, 8)[slots[0]], key[0].to(dtype))
