"""FFD prefill in Triton (interpreter on CPU, compiled on a GPU) against the torch rule
(`ffd_prefill_ref`): whole prompts, chunks that start mid-page and end on page boundaries, single
queries (equal to the Triton decode), GQA 1/3/4/7, head_dim 64 and 128, δ = ∞, "auto" rows below
the crossover, sinks and windows off. Tolerances as in test_ffd_kernels.py: fp32 in the
interpreter (1e-5); bf16 dots when compiled (1e-2, or 5e-2 where a near-threshold block flips).
"""
from __future__ import annotations

import pytest
import torch

from kernels.ffd.decode import ffd_decode
from kernels.ffd.prefill import ffd_prefill, prefill_tile
from kernels.ffd.reference import ffd_prefill_ref
from tests.kernels.test_ffd_kernels import DEV, EXACT, REL_L2, check_close, qp_cpu, to_dev
from tests.support.ffd_helpers import paged_case, params


def prefill_case(lens, q_lens, *, bs, kv_heads, group, dim, seed):
    """paged_case's caches; each sequence's last q_lens[b] tokens are the chunk, with queries near
    the sequence's decode query (so they find its needles) plus noise."""
    q_one, k, v, qp, tables, seq = to_dev(paged_case(lens, bs=bs, kv_heads=kv_heads, group=group, dim=dim,
                                                     seed=seed))
    gen = torch.Generator().manual_seed(seed + 1)
    rows = [q_one[b].cpu()[None] + 0.3 * torch.randn(n, *q_one.shape[1:], generator=gen)
            for b, n in enumerate(q_lens)]
    q = torch.cat(rows).to(DEV)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=DEV)
    return q, k, v, qp, tables, seq, qsl


def compare(case, p, bound=None):
    q, k, v, qp, tables, seq, qsl = case
    scale = q.shape[-1] ** -0.5
    out = ffd_prefill(q, k, v, qp.codes, qp.scales, qp.residual, tables, seq, qsl, scale=scale, params=p)
    ref = ffd_prefill_ref(q.cpu(), k.cpu(), v.cpu(), qp_cpu(qp), tables.cpu(), seq.cpu(), qsl.cpu(),
                          scale=scale, params=p)
    assert torch.isfinite(out).all()
    return check_close(out, ref, "prefill", bound), out


@pytest.mark.parametrize("group, dim", [(1, 64), (3, 64), (4, 128), (7, 64)])
def test_prefill_matches_the_rule_with_gqa(group, dim):
    bs = 16
    lens = [9 * bs + 5, 4 * bs, 2 * bs - 1, 3 * bs + 1]
    q_lens = [9 * bs + 5, 2 * bs + 3, 1, bs]      # whole prompt, mid-page chunk, one query, one page
    case = prefill_case(lens, q_lens, bs=bs, kv_heads=2, group=group, dim=dim, seed=group * dim)
    compare(case, params(bs=bs, delta_log2=2.0, sink=1, window=8), bound=None if EXACT else 5e-2)


@pytest.mark.parametrize("lens, q_lens", [([1], [1]), ([16], [16]), ([17], [17]), ([48], [16]),
                                          ([47], [31]), ([129], [65]), ([129, 3, 64], [1, 3, 33])])
def test_page_boundaries(lens, q_lens):
    case = prefill_case(lens, q_lens, bs=16, kv_heads=1, group=4, dim=64, seed=sum(lens))
    compare(case, params(bs=16, delta_log2=3.0, sink=4, window=16), bound=None if EXACT else 5e-2)


def test_delta_inf_and_no_pseudo_max_keep_everything():
    """δ = ∞ (threshold -inf), and no sinks nor window (no pseudo-max: every block kept)."""
    case = prefill_case([100, 37], [60, 37], bs=16, kv_heads=2, group=2, dim=64, seed=9)
    compare(case, params(bs=16, delta_log2=float("inf"), sink=4, window=16))
    compare(case, params(bs=16, delta_log2=1.0, sink=0, window=0))


def test_auto_rows_below_the_crossover_attend_densely():
    """min_ffd_len inside the chunk: its first queries are dense over exact keys, the rest FFD."""
    case = prefill_case([150, 90], [120, 90], bs=16, kv_heads=2, group=2, dim=64, seed=5)
    compare(case, params(bs=16, delta_log2=1.0, sink=2, window=8, min_ffd_len=64),
            bound=None if EXACT else 5e-2)


def test_one_query_per_sequence_equals_the_decode_kernel():
    """A chunk of one token is a decode step: the prefill kernel and the decode kernel agree."""
    lens = [5 * 16 + 3, 7 * 16, 16 * 16 - 1]
    q, k, v, qp, tables, seq, _ = case = prefill_case(lens, [1, 1, 1], bs=16, kv_heads=2, group=4, dim=64,
                                                        seed=3)
    p = params(bs=16, delta_log2=2.0, sink=1, window=16)
    _, out = compare(case, p, bound=None if EXACT else 5e-2)
    dec = ffd_decode(q, k, v, qp.codes, qp.scales, qp.residual, tables, seq, scale=0.125, params=p)
    check_close(out, dec, "prefill vs decode", REL_L2)


def test_tile_shape():
    assert prefill_tile(1, 128) == (64, 1)
    assert prefill_tile(4, 128) == (16, 4)
    assert prefill_tile(7, 64) == (8, 8)
    assert prefill_tile(32, 128) == (2, 32)
    assert prefill_tile(4, 256) == (8, 4)
