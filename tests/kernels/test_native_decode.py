"""The C++ paged decode kernel against the float64 reference: fresh random pages (shuffled block tables,
stale NaN beyond each sequence), odd lengths and page boundaries, every compiled shape path."""
from __future__ import annotations

import platform

import pytest
import torch

from kernels.attention.reference import decode_attention_ref
from kernels.native.build import FLAGS
from kernels.native.paged_decode import (
    isa,
    library,
    limits,
    paged_decode_attention,
    plan_native_decode,
    unsupported,
)


def paged_inputs(lens, heads, kv_heads, dim, block_size, dtype, seed=0, score_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    pages = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(pages) + 3
    k = (torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen) * score_scale).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(pages + [1]) + 1, dtype=torch.int32)
    used = 0
    for b, (n, count) in enumerate(zip(lens, pages, strict=True)):
        tables[b, :count] = order[used:used + count].int()
        used += count
        if n % block_size:   # the last page's rows past the sequence hold stale values
            last = int(tables[b, count - 1])
            k[last, n % block_size:] = float("nan")
            v[last, n % block_size:] = float("nan")
    for block in order[used:]:   # so do the blocks no sequence owns
        k[block] = float("nan")
        v[block] = float("nan")
    q = torch.randn(len(lens), heads, dim, generator=gen)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def relative_error(out: torch.Tensor, q, k, v, tables, lens, scale) -> float:
    expected = decode_attention_ref(q.double(), k.double(), v.double(), tables, lens, scale=scale)
    live = lens > 0
    assert torch.isfinite(out).all()
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))
    return float((out[live].double() - expected[live]).norm() / expected[live].norm())


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (32, 8, 128), (4, 4, 64), (8, 1, 64),
                                                  (6, 2, 32), (16, 1, 128), (4, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_float64_reference(heads, kv_heads, dim, dtype, block_size):
    lens = [1, block_size - 1, block_size, block_size + 1, 0, 777]
    inputs = paged_inputs(lens, heads, kv_heads, dim, block_size, dtype)
    out = paged_decode_attention(*inputs, scale=dim ** -0.5)
    err = relative_error(out, *inputs, scale=dim ** -0.5)
    print(f"H={heads} Hkv={kv_heads} D={dim} {dtype} BS={block_size}: relative error norm {err:.2e}")
    assert err < 1e-5


@pytest.mark.parametrize("length", [2048, 2049, 5701])
def test_long_sequences_split_and_merge_exactly(length):
    inputs = paged_inputs([length], 9, 3, 64, 16, torch.bfloat16, seed=length)
    q, k, v, tables, lens = inputs
    plans = [plan_native_decode(tables, lens, 9, 3, 64, 16, k.shape[0], num_threads=n) for n in (1, 2, 7)]
    assert plans[0].splits > 1 and len({p.splits for p in plans}) > 1
    outs = [paged_decode_attention(*inputs, scale=0.125, plan=p) for p in plans]
    for out in outs:
        err = relative_error(out, *inputs, scale=0.125)
        print(f"length {length}: relative error norm {err:.2e}")
        assert err < 1e-5


def test_peaked_and_flat_softmax():
    """Scores spanning hundreds (most weights underflow to 0) and scores near zero (all weights near 1)."""
    for score_scale in (40.0, 1e-3):
        inputs = paged_inputs([300, 1000], 8, 2, 64, 16, torch.float32, seed=7, score_scale=score_scale)
        err = relative_error(paged_decode_attention(*inputs, scale=1.0), *inputs, scale=1.0)
        print(f"score scale {score_scale}: relative error norm {err:.2e}")
        assert err < 1e-5


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction-set levels")
@pytest.mark.parametrize("march, expected_isa", [("x86-64-v2", "no wide vectors"), ("x86-64-v3", "AVX2")])
def test_builds_for_older_instruction_sets(march, expected_isa):
    flags = tuple(f"-march={march}" if flag == "-march=native" else flag for flag in FLAGS)
    lib = library(flags)
    assert isa(lib) == expected_isa
    inputs = paged_inputs([33, 1000], 9, 3, 64, 16, torch.bfloat16, seed=3)
    err = relative_error(paged_decode_attention(*inputs, scale=0.125, lib=lib), *inputs, scale=0.125)
    assert err < 1e-5


def test_the_other_vector_width():
    """The build's vector width follows the ISA (16 floats with AVX-512, else 8; every other test here runs this
    machine's): the other width, built here, against float64 over the shapes it unrolls (head_dim 64 and 128)
    and one it does not."""
    width = 8 if limits().dim_multiple == 16 else 16
    lib = library((*FLAGS, f"-DPAGED_DECODE_W={width}"))
    for heads, kv_heads, dim in [(9, 3, 64), (32, 8, 128), (6, 2, 32)]:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = paged_inputs([1, 15, 16, 17, 700], heads, kv_heads, dim, 16, dtype, seed=width + dim)
            err = relative_error(paged_decode_attention(*inputs, scale=dim ** -0.5, lib=lib), *inputs,
                                 scale=dim ** -0.5)
            print(f"W={width} H={heads} Hkv={kv_heads} D={dim} {dtype}: relative error norm {err:.2e}")
            assert err < 1e-5


def test_bad_inputs_are_refused():
    q, k, v, tables, lens = paged_inputs([40, 20], 4, 2, 64, 16, torch.float32)
    bad = tables.clone()
    bad[1, 0] = k.shape[0]
    with pytest.raises(ValueError, match="outside"):
        paged_decode_attention(q, k, v, bad, lens, scale=0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        paged_decode_attention(q, k, v, tables, torch.tensor([40, 10_000], dtype=torch.int32), scale=0.1)
    with pytest.raises(ValueError, match="head_dim 36"):
        paged_decode_attention(q[..., :36], k[..., :36].contiguous(), v[..., :36].contiguous(), tables, lens,
                               scale=0.1)
    with pytest.raises(ValueError, match="float16"):
        paged_decode_attention(q, k.half(), v.half(), tables, lens, scale=0.1)
    with pytest.raises(ValueError, match="query heads"):
        paged_decode_attention(torch.randn(2, 3, 64), k, v, tables, lens, scale=0.1)
    too_many = limits().max_kv_heads + 1   # a work item holds every KV head's state
    assert "KV heads" in unsupported(too_many, too_many, 64, torch.float32)
    assert unsupported(too_many - 1, too_many - 1, 64, torch.float32) is None
    plan = plan_native_decode(tables, lens, 4, 2, 64, 16, k.shape[0])
    with pytest.raises(ValueError, match="plan"):
        paged_decode_attention(q[:1], k, v, tables[:1], lens[:1], scale=0.1, plan=plan)


def test_bf16_queries_give_the_rounded_float32_rows():
    q, k, v, tables, lens = paged_inputs([5, 300, 2100], 9, 3, 64, 16, torch.bfloat16, seed=11)
    q16 = q.bfloat16()
    out = paged_decode_attention(q16, k, v, tables, lens, scale=0.125)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, paged_decode_attention(q16.float(), k, v, tables, lens, scale=0.125).bfloat16())
