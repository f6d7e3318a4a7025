"""FFD Triton kernels (interpreter on CPU, real GPU when present) against the torch reference:
quantize-on-write bit-exact, δ = ∞ equal to dense attention over the refined keys, block masks
equal to the reference's, every block visited at 0..257 blocks, tails 0, 1, BS-1, GQA 1/3/4/7,
head_dim 64 and 128, "auto" rows dense, sparsity counters."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.ffd import ffd_decode, quantize_on_write
from kernels.ffd_reference import dense_over_refined_ref, ffd_decode_ref, quantize_blocks_ref
from tests.ffd_helpers import empty_pages, paged_case, params

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
    err = float((out.cpu().double() - ref).norm() / ref.norm())
    assert err < 1e-5, err
    full = 2 * (num_blocks + 1)
    assert stats.tolist() == [full, full]


def qp_cpu(qp):
    from kernels.ffd_reference import QuantizedPages
    return QuantizedPages(qp.codes.cpu(), qp.scales.cpu(), qp.residual.cpu())


@pytest.mark.parametrize("num_blocks", [127, 128, 129, 257])
def test_every_block_is_visited_and_masks_equal_the_reference(num_blocks):
    bs = 64
    lens = [num_blocks * bs + 63, num_blocks * bs, 3 * bs + 1]
    case = to_dev(paged_case(lens, bs=bs, kv_heads=1, group=4, dim=64, seed=num_blocks))
    p = params(bs=bs, delta_log2=3.0, sink=4, window=64)
    q, k, v, qp, tables, seq = case
    masks = torch.full((3, 1, num_blocks + 1), -1, dtype=torch.int8, device=DEV)
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    out = run(case, p, stats=stats, masks=masks, num_splits=5)
    ref_masks, ref_stats = [], {}
    ref = ffd_decode_ref(q.cpu(), k.cpu(), v.cpu(), qp_cpu(qp), tables.cpu(), seq.cpu(), scale=0.125, params=p,
                         stats=ref_stats, masks=ref_masks)
    for b, n in enumerate(lens):
        nq = n // bs
        assert (masks[b, :, :nq] >= 0).all()                          # visited
        assert torch.equal(masks[b, :, :nq].cpu().bool(), ref_masks[b])
        assert (masks[b, :, nq:] == -1).all()                         # nothing past the full blocks
    assert stats.tolist() == [ref_stats["ffd_blocks_total"], ref_stats["ffd_blocks_kept"]]
    assert ref_stats["ffd_blocks_kept"] < ref_stats["ffd_blocks_total"]   # it really prunes
    err = float((out.cpu() - ref).norm() / ref.norm())
    assert err < 1e-5, err


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
    for b, n in enumerate(lens):
        assert torch.equal(masks[b, :, :n // bs].cpu().bool(), ref_masks[b])
    err = float((out.cpu() - ref).norm() / ref.norm())
    assert err < 1e-5, err


def test_auto_rows_below_the_crossover_are_dense():
    bs = 64
    case = to_dev(paged_case([5 * bs + 3, 2 * bs + 7, 0], bs=bs, kv_heads=2, group=2, dim=64, seed=4))
    p = params(bs=bs, delta_log2=1.0, sink=0, window=8, min_ffd_len=3 * bs)
    q, k, v, qp, tables, seq = case
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    out = run(case, p, stats=stats, num_splits=3)
    ref_stats = {}
    ref = ffd_decode_ref(q.cpu(), k.cpu(), v.cpu(), qp_cpu(qp), tables.cpu(), seq.cpu(), scale=0.125, params=p,
                         stats=ref_stats)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    assert stats.tolist() == [ref_stats["ffd_blocks_total"], ref_stats["ffd_blocks_kept"]] and stats[0] == 10


def test_backend_glue_triton_equals_reference():
    """The engine backend's Triton path (store, quantize on write, decode, counters) against its
    torch path, on the same writes: prefill of 3 sequences, then two decode steps."""
    from engine.config import FlashDecodingConfig
    from engine.ffd_backend import make_ffd_backend
    fd = FlashDecodingConfig(kernel="ffd", ffd_block_size=64, delta=2.0, sink_tokens=4, local_window=64)
    gen = torch.Generator().manual_seed(2)
    backends = [make_ffd_backend(fd, torch.device("cpu"), "cpu") for _ in range(2)]
    backends[1].triton = True
    kv = [torch.zeros(2, 1, 12, 64, 2, 64).to(DEV) for _ in range(2)]
    for backend, cache in zip(backends, kv):
        backend.allocate_cache(cache)
    lens = [200, 130, 63]
    tables = torch.tensor([[1, 5, 2, 9], [3, 4, 10, 0], [7, 0, 0, 0]], dtype=torch.int32, device=DEV)
    slot = lambda b, p: int(tables[b, p // 64]) * 64 + p % 64        # noqa: E731
    slots = torch.tensor([slot(b, p) for b, n in enumerate(lens) for p in range(n)], device=DEV)
    k = torch.randn(len(slots), 2, 64, generator=gen).to(DEV)
    v = torch.randn(len(slots), 2, 64, generator=gen).to(DEV)
    outs, counters = [], []
    for backend, cache in zip(backends, kv):
        backend.store_kv(k, v, cache[0, 0], cache[1, 0], slots)
        steps, c = [], {}
        for step in range(2):                                        # the 63-token sequence fills its page
            new = torch.tensor([slot(b, n + step) for b, n in enumerate(lens)], device=DEV)
            g = torch.Generator().manual_seed(10 + step)
            backend.store_kv(torch.randn(3, 2, 64, generator=g).to(DEV), torch.randn(3, 2, 64, generator=g).to(DEV),
                             cache[0, 0], cache[1, 0], new)
            seq = torch.tensor([n + step + 1 for n in lens], dtype=torch.int32, device=DEV)
            q = torch.randn(3, 8, 64, generator=g).to(DEV)
            steps.append(backend.decode(q, cache[0, 0], cache[1, 0], tables, seq, scale=0.125, layer_idx=0,
                                        counters=c))
        outs.append(torch.stack(steps).cpu())
        counters.append({key: float(val) for key, val in c.items()})
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert counters[1] == counters[0] and counters[0]["ffd_blocks_total"] == 2 * 2 * (3 + 2 + 1)
    assert torch.equal(backends[1].cache.codes, backends[0].cache.codes)
