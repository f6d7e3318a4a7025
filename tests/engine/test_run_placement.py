"""A long prompt's blocks as one run of ids (`engine.core.run_placement`), and what the block manager keeps
doing around it: every block accounted for, prefix hits found, nothing evicted that LRU order would keep
beyond the stretch's slack."""
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_manager import NO_HASH, BlockManager
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence

BLOCK = 4
LONG = 16          # tokens from which a prompt is long (4 blocks)
CHUNK = 8          # prefill chunk, tokens
_prompt_ids = itertools.count(1)


def prompt(n: int) -> Sequence:
    base = next(_prompt_ids) * 100_000
    return Sequence("r", list(range(base, base + n)), SamplingParams())


def step(bm: BlockManager, seq: Sequence, tokens: int) -> None:
    bm.allocate_slots(seq, tokens)
    seq.num_computed_tokens += tokens
    bm.register_full_blocks(seq)


def prefill(bm: BlockManager, seq: Sequence, between=lambda: None) -> None:
    while seq.num_uncomputed_tokens:
        step(bm, seq, min(CHUNK, seq.num_uncomputed_tokens))
        between()


def is_one_run(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


def test_long_prompts_after_the_cache_cycled_are_one_run_each():
    """Prompts of 40 % of the pool one after another: the third meets a cache whose LRU order is the first's
    blocks tail first (not a run); with runs off it gets exactly those, with them on one run."""
    for long_prompt_tokens, expect_runs in ((LONG, True), (10**9, False)):
        bm = BlockManager(40, BLOCK, long_prompt_tokens=long_prompt_tokens)
        tables = []
        for _ in range(4):
            seq = prompt(16 * BLOCK + 1)
            prefill(bm, seq)
            tables.append(list(seq.block_table))
            bm.free(seq)
        assert bm.num_free_blocks == 40
        assert all(is_one_run(t) for t in tables) == expect_runs
        assert all(len(t) == 17 for t in tables)


def test_other_sequences_between_chunks_do_not_break_the_run():
    """A short sequence takes a block after every chunk of a long prompt: LRU order would hand it the ids the
    prompt's run continues into; they were moved to the back of that order, so it gets others."""
    bm = BlockManager(96, BLOCK, long_prompt_tokens=LONG)
    old = prompt(30 * BLOCK)
    prefill(bm, old)
    bm.free(old)                                  # LRU order: 66 never-used blocks, then old's tail first
    decoding = prompt(3)
    step(bm, decoding, 3)                         # takes block 30
    decoding.append_token(7)

    def decode_one_block() -> None:
        for _ in range(BLOCK):
            step(bm, decoding, 1)
            decoding.append_token(7)

    long = prompt(40 * BLOCK)
    prefill(bm, long, between=decode_one_block)
    assert long.block_table == list(range(31, 71))
    assert len(decoding.block_table) == 21 and not set(long.block_table) & set(decoding.block_table)


def test_the_stretch_takes_the_blocks_lru_order_would_evict_first():
    """Two freed prompts, the older at ids 0-9 and the newer at 10-19, the rest in use: a 10-block prompt
    takes the older one's blocks, as LRU order would, and the newer stays findable."""
    bm = BlockManager(24, BLOCK, long_prompt_tokens=LONG)
    older, newer, holder = prompt(10 * BLOCK), prompt(10 * BLOCK), prompt(4 * BLOCK)
    for seq in (older, newer, holder):
        prefill(bm, seq)
    assert older.block_table == list(range(10)) and newer.block_table == list(range(10, 20))
    newer_tokens = list(newer.token_ids)
    bm.free(older)
    bm.free(newer)
    seq = prompt(10 * BLOCK)
    prefill(bm, seq)
    assert seq.block_table == list(range(10))
    again = Sequence("r", newer_tokens + [1], SamplingParams())
    assert bm.allocate_cached_prefix(again) == 10 * BLOCK


def test_a_run_never_evicts_much_more_than_lru_order():
    """The never-used blocks sit apart (ids 0-5 and 18-23) and the 12 between them are a freed prompt's,
    cached: every stretch of 12 would evict 6 of them where LRU's next 12 evict none, so the prompt takes
    the uncached blocks (as two runs) and the freed prompt stays findable whole."""
    bm = BlockManager(24, BLOCK, long_prompt_tokens=LONG)
    pad = prompt(6 * BLOCK)
    prefill(bm, pad)
    cached = prompt(12 * BLOCK)
    prefill(bm, cached)
    cached_tokens = list(cached.token_ids)
    bm.free(pad)
    for block_id in range(6):                     # ids 0-5: free and holding nothing findable
        bm.blocks[block_id].hash = NO_HASH
        bm.cached_mask[block_id] = False
    bm.free(cached)
    seq = prompt(12 * BLOCK)
    prefill(bm, seq)
    assert sorted(seq.block_table) == [*range(6), *range(18, 24)]
    again = Sequence("r", cached_tokens + [1], SamplingParams())
    assert bm.allocate_cached_prefix(again) == 12 * BLOCK


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "free", "hit"]), st.integers(1, 30 * BLOCK)), max_size=25))
def test_block_accounting_holds_under_any_mix(ops):
    """Random long and short prompts, frees and prefix hits: every block is free or referenced by exactly the
    tables that hold it, the cached mask mirrors the hashes, and no two live tables share an unhashed block."""
    bm = BlockManager(48, BLOCK, long_prompt_tokens=LONG)
    live: list[Sequence] = []
    finished: list[list[int]] = []
    for op, n in ops:
        if op == "free" and live:
            seq = live.pop(n % len(live))
            finished.append(list(seq.token_ids))
            bm.free(seq)
            continue
        seq = (Sequence("r", finished[n % len(finished)] + [3], SamplingParams())
               if op == "hit" and finished else prompt(n))
        bm.allocate_cached_prefix(seq)
        if not bm.can_allocate(seq, seq.num_uncomputed_tokens):
            bm.free(seq)
            continue
        prefill(bm, seq)
        live.append(seq)
    refs = np.zeros(48, dtype=int)
    for seq in live:
        for block_id in seq.block_table:
            refs[block_id] += 1
    assert [b.ref_count for b in bm.blocks] == refs.tolist()
    assert set(bm.free_block_ids) == {i for i in range(48) if refs[i] == 0}
    assert bm.cached_mask.tolist() == [b.hash != NO_HASH for b in bm.blocks]
    for block_id in np.flatnonzero(refs > 1):
        assert bm.blocks[block_id].hash != NO_HASH
