"""The compact K cache of kernel = "ffd": exact keys only for pages being filled, in a small pool
(`engine.attention.ffd_cache.ExactKeyPages`, the kernels' `key_page_map`). Kernels (interpreter on CPU,
compiled on a GPU) and the torch rule read a NaN-poisoned pool that holds only the pages a step
may read exactly, and must give what they give over every exact page; the store and the
quantizer write through the map bit for bit; the pool hands out and takes back pages as the
engine's steps fill and free them, and the engine reserves no exact K for full pages."""
from __future__ import annotations

import pytest
import torch

from engine.attention.ffd_cache import ExactKeyPages, exact_pool_pages
from kernels import store_kv
from kernels.attention.reference import store_kv_ref
from kernels.ffd.crossover import crossover_table
from kernels.ffd.decode import ffd_decode
from kernels.ffd.prefill import ffd_prefill
from kernels.ffd.quantize import quantize_on_write
from kernels.ffd.reference import ffd_decode_ref, ffd_prefill_ref, quantize_on_write_ref
from tests.kernels.test_ffd_kernels import DEV, REL_L2, check_close, qp_cpu
from tests.kernels.test_ffd_prefill import prefill_case
from tests.support.ffd_helpers import empty_pages, params


def pool_for(k, pages):
    """A K pool holding only `pages` (at pool pages 1..), NaN elsewhere, and the page -> pool map."""
    pool = torch.full((len(pages) + 1, *k.shape[1:]), float("nan"), dtype=k.dtype, device=k.device)
    kmap = torch.full((k.shape[0],), -1, dtype=torch.int32, device=k.device)
    for i, page in enumerate(pages):
        pool[i + 1] = k[page]
        kmap[page] = i + 1
    return pool, kmap


def chunk_pages(tables, seq, q_lens, bs):
    """The pages a prefill step may read exactly: from the one holding its first query to the last."""
    pages = []
    for b, (n, q_len) in enumerate(zip(seq.tolist(), q_lens, strict=True)):
        pages += tables[b, (n - q_len) // bs:-(-n // bs)].tolist()
    return pages


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [40, 17, 1]])
def test_kernels_and_rule_read_only_the_pool(q_lens):
    bs = 16
    lens = [5 * bs + 3, 7 * bs, 4 * bs - 1]
    q, k, v, qp, tables, seq, qsl = prefill_case(lens, q_lens, bs=bs, kv_heads=2, group=4, dim=64, seed=11)
    pool, kmap = pool_for(k, chunk_pages(tables, seq, q_lens, bs))
    p = params(bs=bs, delta_log2=2.0, sink=1, window=16)
    full = ffd_prefill(q, k, v, qp.codes, qp.scales, qp.residual, tables, seq, qsl, scale=0.125, params=p)
    compact = ffd_prefill(q, pool, v, qp.codes, qp.scales, qp.residual, tables, seq, qsl, scale=0.125, params=p,
                          key_page_map=kmap)
    assert torch.isfinite(compact).all()
    check_close(compact, full, "prefill, pool vs every page", REL_L2)
    ref = ffd_prefill_ref(q.cpu(), pool.cpu(), v.cpu(), qp_cpu(qp), tables.cpu(), seq.cpu(), qsl.cpu(), scale=0.125,
                          params=p, key_page_map=kmap.cpu())
    assert torch.isfinite(ref).all()
    check_close(compact, ref, "prefill, pool vs the rule", None if q_lens[0] == 1 else 5e-2)
    if q_lens == [1, 1, 1]:     # a decode step: only the tails are read
        full = ffd_decode(q, k, v, qp.codes, qp.scales, qp.residual, tables, seq, scale=0.125, params=p)
        compact = ffd_decode(q, pool, v, qp.codes, qp.scales, qp.residual, tables, seq, scale=0.125, params=p,
                             key_page_map=kmap)
        assert torch.isfinite(compact).all()
        check_close(compact, full, "decode, pool vs every page", REL_L2)
        ref = ffd_decode_ref(q.cpu(), pool.cpu(), v.cpu(), qp_cpu(qp), tables.cpu(), seq.cpu(), scale=0.125,
                             params=p, key_page_map=kmap.cpu())
        check_close(compact, ref, "decode, pool vs the rule")


def test_store_and_quantize_through_the_map_are_bit_exact():
    bs, heads, dim = 16, 2, 64
    gen = torch.Generator().manual_seed(3)
    num = 6
    slots = torch.cat([torch.arange(3 * bs, 5 * bs - 3), torch.tensor([-1]), torch.arange(bs, 2 * bs)])  # pages 3, 4, 1
    key = torch.randn(len(slots), heads, dim, generator=gen).to(DEV)
    value = torch.randn(len(slots), heads, dim, generator=gen).to(DEV)
    kmap = torch.tensor([-1, 2, -1, 0, 1, -1], dtype=torch.int32, device=DEV)
    results = []
    for layout in ("full", "pool"):
        k = torch.zeros(num if layout == "full" else 3, bs, heads, dim, device=DEV)
        v = torch.zeros(num, bs, heads, dim, device=DEV)
        qp = empty_pages(num, bs, heads, dim, device=DEV)
        m = kmap if layout == "pool" else None
        store_kv(key, value, k, v, slots.to(DEV), m)
        quantize_on_write(k, qp.codes, qp.scales, qp.residual, slots.to(DEV), m)
        results.append((k, v, qp))
        # the torch reference through the same map writes the same bytes
        k_ref, v_ref, qp_ref = torch.zeros_like(k).cpu(), torch.zeros_like(v).cpu(), empty_pages(num, bs, heads, dim)
        store_kv_ref(key.cpu(), value.cpu(), k_ref, v_ref, slots, None if m is None else m.cpu())
        quantize_on_write_ref(k_ref, qp_ref.codes, qp_ref.scales, qp_ref.residual, slots,
                              None if m is None else m.cpu())
        assert torch.equal(k.cpu(), k_ref) and torch.equal(v.cpu(), v_ref)
        assert torch.equal(qp.codes.cpu(), qp_ref.codes) and torch.equal(qp.scales.cpu(), qp_ref.scales)
    (k_full, v_full, qp_full), (k_pool, v_pool, qp_pool) = results
    assert torch.equal(v_full, v_pool)
    for page in (3, 4, 1):
        assert torch.equal(k_pool[kmap[page]], k_full[page])
    assert torch.equal(qp_pool.codes, qp_full.codes) and torch.equal(qp_pool.scales, qp_full.scales)
    assert torch.equal(qp_pool.residual.view(torch.uint8), qp_full.residual.view(torch.uint8))
    assert int(qp_full.codes[1].sum()) > 0 and int(qp_full.codes[3].sum()) > 0   # pages 1, 3 filled: quantized
    assert int(qp_full.codes[4].sum()) == 0                                      # page 4 not full


def test_pool_pages_come_and_go_with_the_steps():
    pages = ExactKeyPages(num_pages=10, pool_pages=3, device=torch.device("cpu"))
    pages.begin_step(written=[4, 7], filled=[4])            # page 4 fills this step, 7 goes on
    assert pages.key_page_map[4] >= 0 and pages.key_page_map[7] >= 0 and pages.num_in_use == 2
    assert pages.key_page_map[4] != pages.key_page_map[7]
    pages.begin_step(written=[7, 2], filled=[])             # 4 is quantized now: its pool page is back
    assert pages.key_page_map[4] == -1 and pages.num_in_use == 2
    pages.begin_step(written=[7, 2, 5], filled=[])
    assert pages.num_in_use == 3
    with pytest.raises(RuntimeError, match="exact key pages are in use"):
        pages.begin_step(written=[9], filled=[])
    pages.release([2, 5, 7])                                # the block manager freed them
    assert pages.num_in_use == 0 and bool((pages.key_page_map == -1).all())
    assert exact_pool_pages(max_num_seqs=4, max_num_batched_tokens=1024, block_size=64) == 16 + 8


def test_engine_keeps_exact_keys_only_in_the_pool(tmp_path, monkeypatch):
    """kernel = "ffd" sizes the K cache as a pool and more pages fit its budget than "auto"'s, unless
    the pool would cost more than it saves; after a run with preemption every pool page is back."""
    from engine import LLM, SamplingParams
    from tests.support.tiny_models import make_tiny_model
    if torch.cuda.is_available():
        pytest.skip("the tiny model's head_dim 16 is below the FFD kernels' minimum; GPU: test_engine_gpu.py")
    tiny = make_tiny_model(tmp_path, "llama", num_layers=2)
    settings = dict(ffd_block_size=64, delta=0.5, sink_tokens=4, local_window=64, max_num_seqs=4,
                    max_num_batched_tokens=256, cpu_kv_cache_bytes=8 << 20)
    monkeypatch.setitem(crossover_table(), "cpu", 256)
    ffd = LLM(model=tiny, kernel="ffd", **settings).engine
    auto = LLM(model=tiny, kernel="auto", **settings).engine
    pool = exact_pool_pages(4, 256, 64)
    assert ffd.runner.k_cache.shape[1] == pool < ffd.runner.v_cache.shape[1]
    assert auto.runner.k_cache.shape[1] == auto.runner.v_cache.shape[1]
    assert ffd.block_manager.num_blocks > 1.3 * auto.block_manager.num_blocks
    assert "exact keys only for pages being filled" in ffd.backend.name
    # 256 sequences allowed in the same 8 MB: a pool for them would hold fewer pages than the full layout
    crowded = LLM(model=tiny, kernel="ffd", **{**settings, "max_num_seqs": 256}).engine
    assert not crowded.backend.compact and "exact K kept for every page" in crowded.backend.name
    assert crowded.runner.k_cache.shape[1] == crowded.runner.v_cache.shape[1]
    assert crowded.block_manager.num_blocks > (8 << 20) * 0.85 // (crowded.runner.spec.bytes_per_block * 1.5)
    small = LLM(model=tiny, kernel="ffd", num_kv_blocks=9, **settings)
    prompts = [[(5 * j + i) % 200 + 3 for j in range(150 + 20 * i)] for i in range(4)]
    small.generate(prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.backend.exact.num_in_use == 0


def test_async_scheduling_with_the_pool_equals_synchronous(tmp_path):
    """Overlapped decode moves pool pages while a step is in flight (pages filled at different steps,
    rows that end with their next step launched, preemption): the tokens equal the synchronous
    engine's, and every pool page is back at the end."""
    from engine import LLM, SamplingParams
    from tests.support.tiny_models import make_tiny_model
    if torch.cuda.is_available():
        pytest.skip("the tiny model's head_dim 16 is below the FFD kernels' minimum; GPU: test_engine_gpu.py")
    tiny = make_tiny_model(tmp_path, "llama", num_layers=2)
    settings = dict(kernel="ffd", ffd_block_size=64, delta=0.5, sink_tokens=4, local_window=64, max_num_seqs=6,
                    max_num_batched_tokens=256, cpu_kv_cache_bytes=8 << 20, num_kv_blocks=12)
    prompts = [[(7 * i + 3 * j) % 240 + 3 for j in range(40 + 23 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True)
    from tests.engine.test_async_scheduling import count_overlapped_steps
    results = []
    for async_scheduling in (True, False):
        llm = LLM(model=tiny, async_scheduling=async_scheduling, **settings)
        seen = count_overlapped_steps(llm)
        results.append([r.outputs[0].token_ids for r in llm.generate(prompts, params)])
        assert llm.engine.backend.compact and llm.engine.backend.exact.num_in_use == 0
        assert llm.engine.scheduler.num_preemptions > 0
        assert (sum(seen) >= 10) == async_scheduling
    assert results[0] == results[1]
