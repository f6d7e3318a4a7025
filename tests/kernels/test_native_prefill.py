"""The C++ bf16 prefill kernel against the float64 reference (fresh random pages, shuffled block tables,
stale NaN past each sequence, cached prefixes, odd lengths and page boundaries), next to torch SDPA's
error on the same inputs; and a row's output independent of the chunk it is computed in."""
from __future__ import annotations

import pytest
import torch

from kernels.attention.cpu import prefill_attention_cpu
from kernels.attention.reference import prefill_attention_ref
from kernels.native.paged_prefill import library, paged_prefill_attention, unsupported
from tests.support.paged_cache import paged_prefill_inputs, prefill_in_chunks

pytestmark = pytest.mark.skipif(not library().paged_prefill_available(), reason="the CPU has no AVX512-BF16")


def prefill_inputs(lens, q_lens, heads, kv_heads, dim, block_size, seed=0):
    return paged_prefill_inputs(lens, q_lens, heads, kv_heads, dim, block_size, torch.bfloat16, seed)


def errors(inputs, scale):
    """Relative error norms of our bf16 output and of SDPA's; our float32 output checked row by row first
    (its error is the probabilities' bf16 rounding alone, ~1e-3)."""
    q, k, v, tables, lens, starts = inputs
    expected = prefill_attention_ref(q.double(), k.double(), v.double(), tables, lens, starts, scale=scale).double()
    wide = paged_prefill_attention(*inputs, scale=scale, out_dtype=torch.float32).double()
    row_error = (wide - expected).flatten(1).norm(dim=1) / expected.flatten(1).norm(dim=1)
    print(f"float32 output: relative error norm {float((wide - expected).norm() / expected.norm()):.2e}, "
          f"worst row {float(row_error.max()):.2e}")
    assert float((wide - expected).norm() / expected.norm()) < 2e-3 and float(row_error.max()) < 1e-2
    out = paged_prefill_attention(*inputs, scale=scale)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    sdpa = prefill_attention_cpu(*inputs, scale=scale)
    norm = expected.norm()
    return float((out.double() - expected).norm() / norm), float((sdpa.double() - expected).norm() / norm)


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (32, 8, 128), (4, 4, 64), (16, 1, 64), (6, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_float64_reference_as_sdpa_does(heads, kv_heads, dim, block_size):
    # fresh prompts, cached prefixes at and off page and key-block boundaries, one-token rows, a long chunk
    lens = [1, 37, block_size, 100, 129, 64 + 1, 700]
    q_lens = [1, 37, block_size, 30, 1, 2, 200]
    inputs = prefill_inputs(lens, q_lens, heads, kv_heads, dim, block_size)
    ours, sdpa = errors(inputs, dim ** -0.5)
    print(f"H={heads} Hkv={kv_heads} D={dim} BS={block_size}: relative error norm {ours:.2e} (SDPA {sdpa:.2e})")
    assert ours < 3e-3 and ours < 1.1 * sdpa


def test_peaked_scores():
    inputs = prefill_inputs([400], [400], 8, 2, 64, 16, seed=5)
    q = inputs[0] * 8   # scores in the hundreds: most weights underflow
    ours, sdpa = errors((q, *inputs[1:]), 1.0)
    print(f"peaked: relative error norm {ours:.2e} (SDPA {sdpa:.2e})")
    assert ours < 3e-3 and ours < 1.1 * sdpa


def test_rows_do_not_depend_on_the_chunking():
    q, k, v, tables, lens, _ = prefill_inputs([1000], [1000], 9, 3, 64, 16, seed=2)
    whole = paged_prefill_attention(q, k, v, tables, lens, torch.tensor([0, 1000], dtype=torch.int32), scale=0.125)
    pieces = prefill_in_chunks(paged_prefill_attention, q, k, v, tables, [333, 334 + 333, 1000], scale=0.125)
    assert torch.equal(pieces, whole)


def test_bad_inputs_are_refused():
    q, k, v, tables, lens, starts = prefill_inputs([40, 20], [40, 20], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, k, v, tables, lens, torch.tensor([0, 50, 60], dtype=torch.int32), scale=0.1)
    with pytest.raises(ValueError, match="outside"):
        paged_prefill_attention(q, k, v, tables + k.shape[0], lens, starts, scale=0.1)
    with pytest.raises(ValueError, match="bf16 over bf16"):
        paged_prefill_attention(q.half(), k.half(), v.half(), tables, lens, starts, scale=0.1)
    assert "head_dim 96" in unsupported(4, 2, 96, torch.bfloat16, torch.bfloat16)
