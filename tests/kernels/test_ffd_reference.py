"""FFD torch reference: quantizer format and bounds, the per-query rule against independent
oracles (δ = ∞ vs dense over refined keys, masks vs a per-block loop), decode == prefill."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.ffd.reference import (
    FP8,
    RESIDUAL_SCALE,
    FFDParams,
    attend_seq_ref,
    dense_over_refined_ref,
    dequantize_blocks_ref,
    ffd_decode_ref,
    ffd_prefill_ref,
    quantize_blocks_ref,
    unpack_codes_ref,
)
from tests.support.ffd_helpers import paged_case, params


def test_quantizer_format_and_error_bounds():
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(3, 64, 2, 128, generator=gen) * torch.linspace(0.1, 8, 128)
    codes, scales, residual = quantize_blocks_ref(k)
    assert codes.shape == (3, 2, 64, 32) and codes.dtype == torch.uint8
    assert scales.shape == (3, 2, 128) and residual.shape == (3, 2, 64, 128) and residual.dtype == FP8
    kk = k.permute(0, 2, 1, 3)
    torch.testing.assert_close(scales, kk.abs().amax(2) / 1.5, rtol=1e-6, atol=0)
    two_bit = dequantize_blocks_ref(codes, scales)
    assert ((kk - two_bit).abs() <= scales[:, :, None] / 2 * (1 + 1e-6)).all()
    levels = torch.floor(kk / scales[:, :, None]).add(2).clamp(0, 3)
    # the residual is stored in units of s / R: fp8((k/s - (code - 1.5)) * R), |stored| <= R/2
    stored = ((kk / scales[:, :, None] - (levels - 1.5)) * RESIDUAL_SCALE).to(FP8)
    assert torch.equal(residual.view(torch.uint8), stored.view(torch.uint8))
    assert residual.float().abs().max() <= RESIDUAL_SCALE / 2
    refined = dequantize_blocks_ref(codes, scales, residual)
    res = (kk - two_bit).abs()
    err = (kk - refined).abs()
    s = scales[:, :, None].expand_as(err)
    assert (err <= torch.maximum(res * 2.0 ** -4, s * 2.0 ** -18) + 1e-6 * kk.abs()).all()   # e4m3 rounding
    assert (err <= s / 64 * (1 + 1e-5)).all()             # the top binade [R/4, R/2] has step s/32
    # bit layout: channel i + j*D/4 in bits 2j..2j+1 of byte i
    byte = codes[1, 0, 5, 7].item()
    for j in range(4):
        assert (byte >> (2 * j)) & 3 == int(levels[1, 0, 5, 7 + 32 * j])
    assert torch.equal(unpack_codes_ref(codes), levels)


def test_zero_channel_and_large_values_stay_finite():
    k = torch.zeros(1, 16, 1, 8)
    k[0, :, 0, 1] = torch.linspace(-6e4, 6e4, 16)              # residuals far beyond e4m3's 448, unscaled
    codes, scales, residual = quantize_blocks_ref(k)
    refined = dequantize_blocks_ref(codes, scales, residual)
    assert torch.isfinite(refined).all() and refined[0, 0, :, 0].abs().max() == 0
    assert ((refined[0, 0, :, 1] - k[0, :, 0, 1]).abs() <= scales[0, 0, 1] / 64 * (1 + 1e-5)).all()


@pytest.mark.parametrize("magnitude", [2.0 ** -10, 1e-2, 1.0, 30.0])
def test_refined_key_error_does_not_depend_on_the_key_magnitude(magnitude):
    """Small channels keep their precision: an unscaled e4m3 residual of keys ~1e-2 is all
    subnormal (step 2^-9) and reconstructs ~5 % off (~50 % at 2^-10); stored in units of s, ~1.3 %."""
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(4, 128, 2, 64, generator=gen)
    codes, scales, residual = quantize_blocks_ref(k)
    c2, s2, r2 = quantize_blocks_ref(k * magnitude)
    kk = (k * magnitude).permute(0, 2, 1, 3)
    refined = dequantize_blocks_ref(c2, s2, r2)
    assert float((refined - kk).norm() / kk.norm()) < 1.5e-2
    assert ((refined - kk).abs() <= s2[:, :, None] / 64 * (1 + 1e-5)).all()
    if math.log2(magnitude).is_integer():                      # a power of two: the same bytes, scales x it
        assert torch.equal(c2, codes) and torch.equal(r2.view(torch.uint8), residual.view(torch.uint8))
        assert torch.equal(s2, scales * magnitude)
    unscaled = dequantize_blocks_ref(c2, s2) + (kk - dequantize_blocks_ref(c2, s2)).to(FP8).float()
    if magnitude <= 1e-2:                                      # what storing the residual unscaled would give
        assert float((unscaled - kk).norm() / kk.norm()) > 4e-2


@pytest.mark.parametrize("num_blocks", [0, 1, 2, 127, 128, 129, 257])
@pytest.mark.parametrize("tail", [0, 1, 15])
def test_delta_inf_is_dense_over_refined_keys(num_blocks, tail):
    if num_blocks > 2 and tail == 1:
        pytest.skip("long cases: tails 0 and BS-1 suffice")
    bs = 16
    length = num_blocks * bs + tail
    lens = [length, max(1, length // 3 + 5)]                   # mixed lengths in one batch
    q, k, v, qp, tables, seq = paged_case(lens, bs=bs, kv_heads=2, group=3, dim=32, seed=num_blocks + tail)
    p = params(bs=bs, delta_log2=math.inf)
    stats = {}
    out = ffd_decode_ref(q, k, v, qp, tables, seq, scale=0.2, params=p, stats=stats)
    ref = dense_over_refined_ref(q, k, v, qp, tables, seq, scale=0.2, block_size=bs)
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-5, err
    full = sum(n // bs for n in lens) * 2
    assert stats["ffd_blocks_total"] == full and stats["ffd_blocks_kept"] == full


def _mask_by_loops(q, k, v, qp, table, length, scale, p: FFDParams):
    """Keep mask [Hkv, nq] computed block by block with plain loops (independent of the reference)."""
    bs, kv_heads = p.block_size, k.shape[2]
    group = q.shape[0] // kv_heads
    nq = length // bs
    pages = table.long()
    scores = []                                                 # best score per token per head
    for t in range(length):
        page, row = pages[t // bs], t % bs
        if t < nq * bs:
            key = dequantize_blocks_ref(qp.codes[page:page + 1], qp.scales[page:page + 1],
                                        qp.residual[page:page + 1])[0, :, row]
        else:
            key = k[page, row].float()
        scores.append(torch.stack([q[h] @ key[h // group] * scale for h in range(q.shape[0])]))
    scores = torch.stack(scores, 1)                            # [Hq, L]
    chosen = [t for t in range(length) if t < p.sink_tokens or t > length - 1 - p.local_window]
    m = scores[:, chosen].amax(1)
    keep = torch.zeros(kv_heads, nq, dtype=torch.bool)
    for b in range(nq):
        page = pages[b]
        two = dequantize_blocks_ref(qp.codes[page:page + 1], qp.scales[page:page + 1])[0]   # [H, BS, D]
        for h in range(q.shape[0]):
            best = (two[h // group] @ q[h]).max() * scale
            keep[h // group, b] |= bool(best >= m[h] - p.delta_nat)
        forced = b < -(-p.sink_tokens // bs) or (b + 1) * bs > length - p.local_window
        keep[:, b] |= forced
    return keep, scores


@pytest.mark.parametrize("group", [1, 3, 4, 7])
@pytest.mark.parametrize("dim", [64, 128])
def test_masks_and_output_match_independent_loops(group, dim):
    bs = 16
    lens = [bs * 9 + 5, bs * 4, bs * 2 - 1]
    q, k, v, qp, tables, seq = paged_case(lens, bs=bs, kv_heads=2, group=group, dim=dim, seed=group + dim)
    p = params(bs=bs, delta_log2=3.0, sink=2, window=8)
    scale = dim ** -0.5
    masks = []
    out = ffd_decode_ref(q, k, v, qp, tables, seq, scale=scale, params=p, masks=masks)
    pruned = 0
    for b, length in enumerate(lens):
        keep, scores = _mask_by_loops(q[b], k, v, qp, tables[b], length, scale, p)
        assert torch.equal(masks[b], keep)
        pruned += int((~keep).sum())
        nq = length // bs
        allowed = torch.ones(k.shape[2], length, dtype=torch.bool)
        allowed[:, :nq * bs] = keep.repeat_interleave(bs, dim=1)
        allowed = allowed.repeat_interleave(group, dim=0)
        w = torch.softmax(scores.masked_fill(~allowed, float("-inf")).double(), dim=1)
        vals = v[tables[b].long()].reshape(-1, k.shape[2], dim)[:length].double()
        expect = torch.einsum("ht,thd->hd", w, vals.repeat_interleave(group, dim=1))
        assert (out[b].double() - expect).norm() / expect.norm() < 1e-5
    assert pruned > 0                                           # the structured data really prunes


def test_prefill_applies_the_decode_rule_to_every_query():
    bs = 16
    length = bs * 6 + 7
    _, k, v, qp, tables, _ = paged_case([length], bs=bs, kv_heads=2, group=2, dim=32, seed=5)
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(length, 4, 32, generator=gen)
    p = params(bs=bs, delta_log2=2.0, sink=1, window=5)
    # the last 40 tokens as one prefill chunk, against 40 decode steps at growing lengths
    chunk = q[-40:]
    out = ffd_prefill_ref(chunk, k, v, qp, tables, torch.tensor([length], dtype=torch.int32),
                          torch.tensor([0, 40], dtype=torch.int32), scale=0.3, params=p, max_scores=2000)
    for i in range(40):
        n = length - 40 + i + 1
        one = ffd_decode_ref(chunk[i:i + 1], k, v, qp, tables, torch.tensor([n], dtype=torch.int32),
                             scale=0.3, params=p)
        torch.testing.assert_close(out[i], one[0], rtol=1e-4, atol=1e-5)


def test_auto_below_crossover_is_exact_dense_attention():
    bs = 16
    q, k, v, qp, tables, seq = paged_case([bs * 5 + 3, bs * 2], bs=bs, kv_heads=1, group=2, dim=32, seed=3)
    p = params(bs=bs, delta_log2=0.5, sink=0, window=4, min_ffd_len=bs * 3)
    stats = {}
    out = ffd_decode_ref(q, k, v, qp, tables, seq, scale=0.3, params=p, stats=stats)
    from kernels.attention.reference import decode_attention_ref
    dense = decode_attention_ref(q, k, v, tables, seq, scale=0.3)
    torch.testing.assert_close(out[1], dense[1], rtol=1e-5, atol=1e-6)   # short: dense, exact keys
    assert stats["ffd_blocks_total"] == 5                                # only the long one counts


def test_attend_seq_handles_no_full_block():
    q = torch.randn(3, 2, 8)
    k, v = torch.randn(10, 1, 8), torch.randn(10, 1, 8)
    empty = torch.zeros(0, 1, 8)
    out, keep, nq = attend_seq_ref(q, torch.tensor([0, 4, 9]), k, v, empty, empty, 0.5, params(bs=16))
    assert keep.shape == (3, 1, 0) and nq.tolist() == [0, 0, 0]
    w = torch.softmax(torch.einsum("hd,td->ht", q[2], k[:, 0]) * 0.5, dim=1)
    torch.testing.assert_close(out[2], w @ v[:, 0], rtol=1e-5, atol=1e-6)
