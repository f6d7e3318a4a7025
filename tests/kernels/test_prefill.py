"""The paged prefill kernel against a float64 oracle written from the definition.

Cases cover what the kernel's two loops and head packing must get right: chunks that start and end
on page and KV-tile boundaries and one off them, cached prefixes of 0, 1 and many pages, GQA groups
of 1, 3, 4 and 8 (packed 1, 2, 4 or 8 heads to a tile), head_dim 64 and 128, several sequences
and a decode row in one call. Under the interpreter (no GPU) the tiles are small so that every case
has unmasked tiles before the diagonal; on a GPU the vendor's own configs run at Llama-3.1-8B shapes.
"""
from __future__ import annotations

import zlib

import pytest
import torch

from kernels import prefill_attention
from kernels.attention.prefill import heads_per_tile, launch_shape
from kernels.vendor import PrefillConfig, vendor_configs
from tests.support.paged_cache import shuffled_tables

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 is exact in the interpreter; on a GPU tl.dot runs float32 as tf32.
TOL = {torch.float32: 1e-5 if DEVICE == "cpu" else 5e-3, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def oracle(q, k_cache, v_cache, tables, seq_lens, q_lens, scale):
    """float64, one sequence at a time: its new tokens are the last q_len of seq_len."""
    out = torch.empty(q.shape, dtype=torch.float64)
    page = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    start = 0
    for b, (length, q_len) in enumerate(zip(seq_lens.tolist(), q_lens, strict=True)):
        pages = tables[b, :(length + page - 1) // page].long().cpu()
        k = k_cache.cpu()[pages].flatten(0, 1)[:length].double().repeat_interleave(group, 1)
        v = v_cache.cpu()[pages].flatten(0, 1)[:length].double().repeat_interleave(group, 1)
        qb = q.cpu()[start:start + q_len].double()
        scores = torch.einsum("thd,lhd->htl", qb, k) * scale
        pos = torch.arange(length - q_len, length)[:, None]
        scores = scores.masked_fill(torch.arange(length)[None, :] > pos, float("-inf"))
        out[start:start + q_len] = torch.einsum("htl,lhd->thd", scores.softmax(-1), v)
        start += q_len
    return out


def paged_prefill_case(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, page, dtype, seed):
    """Fresh random q and pages (spare garbage pages, NaN-free), shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [(n + page - 1) // page for n in seq_lens]
    num_blocks = sum(pages_per_seq) + 2
    k = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables = shuffled_tables(pages_per_seq, num_blocks, gen)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k, v, tables, lens, qsl)]


def rel_err(out, ref):
    return float((out.double().cpu() - ref).norm() / ref.norm())


# Interpreter tiles: 32 rows x 16 keys with page 16, so a 70-token chunk already has unmasked
# tiles, several diagonal tiles and a partial last tile; pack up to 8 heads per tile.
SMALL = PrefillConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, pack=8)

# (seq_lens, q_lens): cached prefix = seq_len - q_len.
BATCHES = {
    "cold odd": ([37], [37]),
    "cold on page and tile edges": ([64], [64]),
    "after 1 cached page": ([16 + 33], [33]),
    "after many pages, chunk ends on a page": ([5 * 16 + 48], [48]),
    "after a partial page": ([16 * 3 + 5 + 17], [17]),
    "three sequences and a decode row": ([70, 29, 100, 41], [70, 13, 31, 1]),
}


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (8, 2), (16, 2)], ids=["gqa1", "gqa3", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_matches_float64(batch, heads, head_dim):
    seq_lens, q_lens = BATCHES[batch]
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v, tables, lens, qsl = paged_prefill_case(seq_lens, q_lens, *heads, head_dim, 16, dtype,
                                                    seed=zlib.crc32(f"{batch}/{heads}/{head_dim}".encode()))
    config = SMALL if DEVICE == "cpu" else None
    out = prefill_attention(q, k, v, tables, lens, qsl, scale=head_dim ** -0.5, max_query_len=max(q_lens),
                            config=config)
    err = rel_err(out, oracle(q, k, v, tables, lens, q_lens, head_dim ** -0.5))
    assert err < TOL[dtype], f"relative error norm {err:.2e}"


@pytest.mark.parametrize("tma", [False, True], ids=["pointer-loads", "tma"])
@pytest.mark.parametrize("pack", [1, 2, 4])
def test_every_packing_and_load_path_give_the_same_attention(pack, tma):
    """One case through packings 1, 2 and 4 of a GQA-4 model, pages of two KV tiles, unmasked tiles
    loaded by pointers or through the TMA descriptors; unwritten slots hold NaN."""
    q, k, v, tables, lens, qsl = paged_prefill_case([150, 90], [61, 90], 8, 2, 64, 32, torch.float32, seed=5)
    for cache, length in ((k, 150), (v, 90)):   # the slots after each sequence's end in its last page
        cache[tables[0 if length == 150 else 1, (length - 1) // 32].long(), length % 32:] = float("nan")
    config = PrefillConfig(block_m=32, block_n=16, num_stages=1, pack=pack, tma=tma)
    if tma and DEVICE == "cuda" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs compute capability 9.0")
    out = prefill_attention(q, k, v, tables, lens, qsl, scale=0.125, max_query_len=90, config=config)
    assert rel_err(out, oracle(q, k, v, tables, lens, [61, 90], 0.125)) < TOL[torch.float32]


def test_tma_needs_pages_that_hold_whole_tiles():
    from kernels.attention.tma import tma_descriptors

    _, k, v, _, _, _ = paged_prefill_case([64], [64], 2, 2, 64, 16, torch.float32, seed=1)
    assert tma_descriptors(k, v, block_n=32, enabled=True) is None        # a tile would span two pages
    assert tma_descriptors(k, v, block_n=16, enabled=False) is None
    if DEVICE == "cpu":                                                    # the interpreter has them
        assert tma_descriptors(k, v, block_n=16, enabled=True) is not None


def test_heads_per_tile():
    assert heads_per_tile(group=4, max_pack=8, block_m=64) == 4
    assert heads_per_tile(group=8, max_pack=4, block_m=64) == 4
    assert heads_per_tile(group=3, max_pack=8, block_m=64) == 1     # SmolLM2: 9 heads over 3
    assert heads_per_tile(group=6, max_pack=8, block_m=64) == 2
    assert heads_per_tile(group=8, max_pack=8, block_m=4) == 4       # never more heads than rows


def test_wide_tiles_only_where_their_grid_fills_the_gpu():
    """NVIDIA's 256-row tiles for a 2,048-token chunk of Llama-3.1-8B heads on 132 SMs (256 programs), its
    128-row default at 1,024 tokens (128 programs: fewer than the SMs) and for a config without a wide shape."""
    base = vendor_configs("nvidia").prefill_for(128)
    assert base.wide is not None and base.wide.block_m > base.block_m
    assert launch_shape(base, 2048, 32, 4, 1, 132) is base.wide
    assert launch_shape(base, 1024, 32, 4, 1, 132) is base
    assert launch_shape(base, 1024, 32, 4, 2, 132) is base.wide          # two sequences' chunks: 256 programs
    assert launch_shape(base, 2048, 32, 4, 1, 264) is base               # a GPU with twice the SMs
    plain = PrefillConfig()
    assert launch_shape(plain, 65536, 32, 4, 8, 132) is plain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("prefix, chunk", [(0, 4096 + 7), (16 * 200 + 1, 2048), (32768 - 16, 2048 + 16),
                                           (5000, 1024)])
def test_gpu_llama_shapes(prefix, chunk):
    """Llama-3.1-8B heads (32 over 8, D=128), bf16, the vendor config, long prefixes: chunks of 2,048 tokens
    and more take its wide tiles on an H100 or H200, the 1,024-token chunk its default."""
    q, k, v, tables, lens, qsl = paged_prefill_case([prefix + chunk], [chunk], 32, 8, 128, 16,
                                                    torch.bfloat16, seed=prefix)
    out = prefill_attention(q, k, v, tables, lens, qsl, scale=128 ** -0.5, max_query_len=chunk)
    assert rel_err(out, oracle(q, k, v, tables, lens, [chunk], 128 ** -0.5)) < 1e-2
