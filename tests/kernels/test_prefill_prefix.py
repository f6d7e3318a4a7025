"""The prefill over a cached prefix attended outside the kernel (`kernels.attention.prefix`): the kernel
resumed from a prefix's softmax state must equal the whole causal attention (float64 oracle).

Under the interpreter the prefix is attended by the float32 torch reference; on a GPU by cuDNN, which
is also checked on its own against the reference. Cases: key starts on and off pages (tiles of 16 in
pages of 16 and 32), a sequence with a span beside sequences without one and a decode row, GQA 1/4/8,
head_dim 64/128.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from kernels import prefill_attention
from kernels.attention.prefix import (
    PrefixSpan,
    plan_prefix,
    prefix_attention_cudnn,
    prefix_attention_ref,
    prefix_pages,
    prefix_seed,
    prefix_spans,
)
from kernels.attention.reference import gather_kv_ref
from kernels.vendor import PrefillConfig
from tests.kernels.test_prefill import DEVICE, oracle, paged_prefill_case, rel_err

SMALL = PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, pack=8)
ON_GPU = DEVICE == "cuda"


def test_prefix_spans_take_long_prefixes_on_tile_boundaries():
    # seq 0: 100 new over 500 cached; seq 1: too few rows; seq 2: too few keys; seq 3: 64 new over 200
    spans = prefix_spans([600, 300, 90, 264], [0, 100, 101, 141, 205], min_keys=128, min_rows=64, align=64)
    assert spans == [PrefixSpan(0, 0, 100, 448), PrefixSpan(3, 141, 205, 192)]


def test_the_prefix_gather_reads_the_pages_in_table_order():
    _, k, _, tables, _, _ = paged_prefill_case([70], [70], 2, 2, 64, 16, torch.float32, seed=3)
    got = gather_kv_ref(k, tables[0], 37)
    want = torch.cat([k[int(p)] for p in tables[0, :3]])[:37]
    assert torch.equal(got, want)


def test_page_runs_are_found_only_where_the_blocks_are_consecutive():
    table = torch.tensor([7, 8, 9, 10, 3, 4], dtype=torch.int32)
    spans = [PrefixSpan(0, 0, 10, 64), PrefixSpan(1, 10, 20, 80)]   # 4 and 5 pages of 16
    plan = plan_prefix(spans, 2, torch.device("cpu"), torch.stack([table, table]), 16)
    assert [s.run.first_block if s.run else None for s in plan.spans] == [7, None]


def test_a_run_of_pages_is_read_in_place_and_equals_the_gather():
    _, k, _, _, _, _ = paged_prefill_case([70], [70], 2, 2, 64, 16, torch.float32, seed=5)
    table = torch.arange(1, 1 + k.shape[0] - 1, dtype=torch.int32)
    span = plan_prefix([PrefixSpan(0, 0, 1, 37)], 1, torch.device("cpu"), table[None], 16).spans[0]
    assert span.run is not None and span.run.first_block == 1
    got = prefix_pages(k, table, span)
    assert torch.equal(got, gather_kv_ref(k, table, 37))
    assert got.data_ptr() == k[1].data_ptr(), "a run of pages is a view of the cache, not a copy"


CASES = {
    # (seq_lens, q_lens, page, min_keys): every sequence with >= min_keys cached keys gets a span
    "one sequence, key start on a page": ([16 * 6 + 45], [45], 16, 16),
    "one sequence, key start inside a page of 32": ([32 * 3 + 16 + 29], [29], 32, 16),
    "spans beside a cold sequence and a decode row": ([130, 41, 77, 95], [33, 41, 1, 50], 16, 32),
}


@pytest.mark.skipif(ON_GPU, reason="interpreter tiles; test_gpu_seeded_prefill runs the vendor's on a GPU")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("heads", [(2, 2), (8, 2), (16, 2)], ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_seeded_prefill_equals_the_whole_attention(case, heads, head_dim):
    seq_lens, q_lens, page, min_keys = CASES[case]
    q, k, v, tables, lens, qsl = paged_prefill_case(seq_lens, q_lens, *heads, head_dim, page, torch.float32,
                                                    seed=zlib.crc32(f"{case}/{heads}/{head_dim}".encode()))
    spans = prefix_spans(seq_lens, qsl.tolist(), min_keys=min_keys, min_rows=2, align=SMALL.block_n)
    assert spans, "the case must attend some prefix outside the kernel"
    scale = head_dim ** -0.5
    seed = prefix_seed(q, k, v, tables, plan_prefix(spans, len(seq_lens), q.device), scale,
                       attend=prefix_attention_ref)
    out = prefill_attention(q, k, v, tables, lens, qsl, scale=scale, max_query_len=max(q_lens), config=SMALL,
                            seed=seed)
    err = rel_err(out, oracle(q, k, v, tables, lens, q_lens, scale))
    assert err < 1e-5, f"relative error norm {err:.2e}"


@pytest.mark.skipif(ON_GPU, reason="interpreter tiles")
def test_seeded_prefill_over_a_run_of_pages_equals_the_whole_attention():
    seq_lens, q_lens = [16 * 7 + 9, 16 * 5 + 3], [25, 40]
    q, k, v, _, lens, qsl = paged_prefill_case(seq_lens, q_lens, 8, 2, 64, 16, torch.float32, seed=21)
    tables = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 0, 0]], dtype=torch.int32)
    spans = prefix_spans(seq_lens, qsl.tolist(), min_keys=16, min_rows=2, align=SMALL.block_n)
    plan = plan_prefix(spans, 2, q.device, tables, 16)
    assert [s.run.first_block if s.run else None for s in plan.spans] == [0, 8]
    seed = prefix_seed(q, k, v, tables, plan, 0.125, attend=prefix_attention_ref)
    out = prefill_attention(q, k, v, tables, lens, qsl, scale=0.125, max_query_len=40, config=SMALL, seed=seed)
    err = rel_err(out, oracle(q, k, v, tables, lens, q_lens, 0.125))
    assert err < 1e-5, f"relative error norm {err:.2e}"


def test_seed_with_an_unaligned_key_start_is_refused():
    q, k, v, tables, lens, qsl = paged_prefill_case([100], [30], 2, 2, 64, 16, torch.float32, seed=9)
    seed = prefix_seed(q, k, v, tables, plan_prefix([PrefixSpan(0, 0, 30, 40)], 1, q.device), 0.125,
                       attend=prefix_attention_ref)
    with pytest.raises(ValueError, match="multiple of the KV tile"):
        prefill_attention(q, k, v, tables, lens, qsl, scale=0.125, max_query_len=30, config=SMALL, seed=seed)


def test_prefix_reference_matches_float64():
    gen = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(7, 8, 64, generator=gen), torch.randn(50, 2, 64, generator=gen), torch.randn(50, 2, 64,
                                                                                                   generator=gen)
    out, lse = prefix_attention_ref(q, k, v, 0.125)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(4, 1)) * 0.125
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double().repeat_interleave(4, 1))
    assert rel_err(out, want) < 1e-6
    assert float((lse.double() - scores.logsumexp(-1)).abs().max()) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_cudnn_prefix_matches_the_reference(head_dim):
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    q = torch.randn(777, 32, head_dim, device="cuda", generator=gen).bfloat16()
    k = torch.randn(5000, 8, head_dim, device="cuda", generator=gen).bfloat16()
    v = torch.randn(5000, 8, head_dim, device="cuda", generator=gen).bfloat16()
    out, lse = prefix_attention_cudnn(q, k, v, head_dim ** -0.5)
    ref_out, ref_lse = prefix_attention_ref(q, k, v, head_dim ** -0.5)
    assert rel_err(out, ref_out.double().cpu()) < 1e-2
    assert float((lse - ref_lse).abs().max()) < 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("prefix, chunk", [(16 * 300 + 5, 2048 + 3), (8192, 1000)])
def test_gpu_seeded_prefill(prefix, chunk, page):
    """Llama-3.1-8B heads, bf16, the vendor config; cuDNN over the prefix, the kernel over the rest."""
    q, k, v, tables, lens, qsl = paged_prefill_case([prefix + chunk], [chunk], 32, 8, 128, page, torch.bfloat16,
                                                    seed=prefix + page)
    spans = prefix_spans([prefix + chunk], [0, chunk], min_keys=128, min_rows=1, align=128)
    seed = prefix_seed(q, k, v, tables, plan_prefix(spans, 1, q.device), 128 ** -0.5)
    out = prefill_attention(q, k, v, tables, lens, qsl, scale=128 ** -0.5, max_query_len=chunk, seed=seed)
    assert rel_err(out, oracle(q, k, v, tables, lens, [chunk], 128 ** -0.5)) < 1e-2
