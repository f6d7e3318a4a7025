"""The C++ float32 prefill kernel against the float64 reference: fresh random pages (float32 and bf16) under
shuffled block tables, NaN in every slot no sequence owns, cached prefixes on and off page and 64-key span
boundaries, one-token rows, odd lengths; groups that fill the vector lanes and groups that leave some spare;
both vector widths; SDPA's error on the same inputs beside ours. And a row's output independent of the chunk
it is computed in."""
from __future__ import annotations

import pytest
import torch

from kernels.attention.cpu import prefill_attention_cpu
from kernels.attention.reference import prefill_attention_ref
from kernels.native.build import FLAGS
from kernels.native.paged_prefill import library_f32, paged_prefill_attention, unsupported
from tests.support.paged_cache import paged_prefill_inputs, prefill_in_chunks

pytestmark = pytest.mark.skipif(not library_f32().paged_prefill_f32_available(),
                                reason="the build targets neither AVX2 nor AVX-512")

# prompts from nothing, chunks after cached prefixes at and off page and span (64-key) boundaries, one-token
# rows, a long chunk
LENS = [1, 37, 64, 100, 129, 65, 700, 1000]
Q_LENS = [1, 37, 64, 30, 1, 2, 200, 436]


def relative_errors(inputs, scale, f32_library=None):
    """Relative error norms of the kernel's output and of SDPA's against float64; the kernel's rows finite."""
    q, k, v, tables, lens, starts = inputs
    expected = prefill_attention_ref(q.double(), k.double(), v.double(), tables, lens, starts, scale=scale).double()
    out = paged_prefill_attention(*inputs, scale=scale, f32_library=f32_library)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    sdpa = prefill_attention_cpu(q, k.float(), v.float(), tables, lens, starts, scale=scale)
    norm = expected.norm()
    return float((out.double() - expected).norm() / norm), float((sdpa.double() - expected).norm() / norm)


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (32, 8, 128), (4, 4, 64), (16, 1, 64), (10, 2, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(heads, kv_heads, dim, block_size, kv_dtype):
    inputs = paged_prefill_inputs(LENS, Q_LENS, heads, kv_heads, dim, block_size, kv_dtype, q_dtype=torch.float32)
    ours, sdpa = relative_errors(inputs, dim ** -0.5)
    print(f"H={heads} Hkv={kv_heads} D={dim} BS={block_size} {kv_dtype}: relative error norm {ours:.2e} "
          f"(SDPA {sdpa:.2e})")
    assert ours < 1e-6 and ours < 1.5 * sdpa


def test_the_other_vector_width():
    width = 8 if library_f32().paged_prefill_f32_vector_width() == 16 else 16
    lib = library_f32((*FLAGS, f"-DPAGED_PREFILL_W={width}"))
    assert lib.paged_prefill_f32_vector_width() == width
    for heads, kv_heads, dim in [(9, 3, 64), (10, 2, 128)]:
        inputs = paged_prefill_inputs(LENS, Q_LENS, heads, kv_heads, dim, 16, torch.float32)
        ours, sdpa = relative_errors(inputs, dim ** -0.5, f32_library=lib)
        print(f"width {width}, H={heads} Hkv={kv_heads} D={dim}: relative error norm {ours:.2e} (SDPA {sdpa:.2e})")
        assert ours < 1e-6 and ours < 1.5 * sdpa


def test_peaked_scores():
    q, *rest = paged_prefill_inputs([400], [400], 8, 2, 64, 16, torch.float32, seed=5)
    ours, sdpa = relative_errors((q * 8, *rest), 1.0)   # scores in the hundreds: most weights underflow
    print(f"peaked: relative error norm {ours:.2e} (SDPA {sdpa:.2e})")
    assert ours < 1e-6


def test_rows_do_not_depend_on_the_chunking():
    q, k, v, tables, lens, _ = paged_prefill_inputs([1000], [1000], 9, 3, 64, 16, torch.float32, seed=2)
    whole = paged_prefill_attention(q, k, v, tables, lens, torch.tensor([0, 1000], dtype=torch.int32), scale=0.125)
    pieces = prefill_in_chunks(paged_prefill_attention, q, k, v, tables, [333, 334 + 333, 1000], scale=0.125)
    assert torch.equal(pieces, whole)


def test_what_it_does_not_take():
    q, k, v, tables, lens, starts = paged_prefill_inputs([40, 20], [40, 20], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="query_start_loc"):
        paged_prefill_attention(q, k, v, tables, lens, torch.tensor([0, 50, 60], dtype=torch.int32), scale=0.1)
    with pytest.raises(ValueError, match="outside"):
        paged_prefill_attention(q, k, v, tables + k.shape[0], lens, starts, scale=0.1)
    assert "head_dim 96" in unsupported(4, 2, 96, torch.float32, torch.float32)
    assert "groups of at most 16" in unsupported(34, 2, 64, torch.float32, torch.float32)
    assert "pages" in unsupported(4, 2, 64, torch.float32, torch.float8_e4m3fn)
