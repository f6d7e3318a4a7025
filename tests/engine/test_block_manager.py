"""BlockManager: allocation, reference counts, prefix-cache hits (verified) and lazy eviction."""
import pytest

from engine.core.block_manager import BlockManager
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence


def make_seq(tokens):
    return Sequence("r", list(tokens), SamplingParams())


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    n = seq.num_uncomputed_tokens
    bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    bm.register_full_blocks(seq)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, 4)
    seq = make_seq(range(10))
    assert bm.blocks_needed(seq, 10) == 3
    compute_all(bm, seq)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_prefix_hit_shares_blocks_and_counts_tokens():
    bm = BlockManager(16, 4)
    a = make_seq(list(range(100, 113)))  # 13 tokens: 3 full blocks
    compute_all(bm, a)
    b = make_seq(list(range(100, 112)) + [7, 8, 9])  # shares 12 tokens = 3 blocks
    reused = bm.allocate_cached_prefix(b)
    assert reused == 12 and b.num_computed_tokens == 12
    assert b.block_table == a.block_table[:3]
    assert all(bm.blocks[i].ref_count == 2 for i in b.block_table)


def test_hit_leaves_one_token_to_compute():
    bm = BlockManager(16, 4)
    a = make_seq(range(8))
    compute_all(bm, a)
    b = make_seq(range(8))  # identical 8-token prompt: only the first block may be reused
    assert bm.allocate_cached_prefix(b) == 4


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(4, 4)
    a = make_seq(range(8))
    compute_all(bm, a)
    bm.free(a)
    b = make_seq(list(range(8)) + [99])
    assert bm.allocate_cached_prefix(b) == 8
    bm.free(b)
    # Allocating every block evicts the cached ones; then nothing is found.
    c = make_seq(range(1000, 1016))
    compute_all(bm, c)
    bm.free(c)
    d = make_seq(list(range(8)) + [5])
    assert bm.allocate_cached_prefix(d) == 0


def test_hash_collision_is_rejected_by_token_check():
    bm = BlockManager(8, 4)
    a = make_seq(range(9))
    compute_all(bm, a)
    block = bm.blocks[a.block_table[0]]
    block.token_ids = [42, 42, 42, 42]  # pretend the cached contents differ from what the hash says
    b = make_seq(range(9))
    assert bm.allocate_cached_prefix(b) == 0


def test_allocate_without_room_raises():
    bm = BlockManager(2, 4)
    seq = make_seq(range(12))
    assert not bm.can_allocate(seq, 12)
    with pytest.raises(RuntimeError):
        bm.allocate_slots(seq, 12)


def test_prefix_caching_off():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    a = make_seq(range(9))
    compute_all(bm, a)
    assert bm.allocate_cached_prefix(make_seq(range(9))) == 0
