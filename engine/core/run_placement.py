"""Where a long prompt's blocks go: one run of consecutive block ids, chunk after chunk.

Least-recently-freed order alone does not give a run once the cache has cycled: the blocks it would evict
next are older prompts' tails and the never-used blocks, scattered over the ids. So a long prompt's prefill
chunk first continues its sequence's run (the ids right after its last block, when all are free); failing
that, it starts one in a stretch of free blocks wide enough for the rest of the sequence. The stretch evicts
hardly more cached blocks than least-recently-freed order would for as many blocks, and among such stretches it
is the one whose cached blocks that order would evict soonest (the least sum of their positions in it).
The stretch's later blocks move to the back of that order, so other sequences' allocations between chunks
take them last.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Protocol

import numpy as np

from engine.request.sequence import Sequence

# A stretch may hold up to want / EVICTION_SLACK more cached blocks than LRU order's next `want` (their
# partly filled tail blocks hold no hash, so LRU's count runs a little low against any stretch of full ones).
EVICTION_SLACK = 16


class FreeBlockPool(Protocol):
    """What the placement reads of the block manager."""

    block_size: int
    free_block_ids: OrderedDict[int, None]   # least recently freed first
    cached_mask: np.ndarray                  # [num_blocks] bool: the block holds a published hash

    @property
    def num_blocks(self) -> int: ...


def place_run(pool: FreeBlockPool, seq: Sequence, needed: int) -> list[int] | None:
    """The `needed` free block ids for `seq`'s next chunk as a run, or None (take them in LRU order)."""
    ids = _continuation(pool, seq, needed)
    if ids is not None:
        return ids
    want = max(needed, -(-len(seq) // pool.block_size) - len(seq.block_table))
    start = _lru_run_start(pool, want)
    if start is None:
        start = cheapest_stretch(pool, want)
    if start is None:
        return None
    for later in range(start + needed, start + want):
        pool.free_block_ids.move_to_end(later)
    return list(range(start, start + needed))


def _continuation(pool: FreeBlockPool, seq: Sequence, needed: int) -> list[int] | None:
    if not seq.block_table:
        return None
    first = seq.block_table[-1] + 1
    ids = list(range(first, first + needed))
    free = pool.free_block_ids
    return ids if ids[-1] < pool.num_blocks and all(i in free for i in ids) else None


def _lru_run_start(pool: FreeBlockPool, want: int) -> int | None:
    """The first id of the `want` blocks LRU order hands out next, when they are consecutive ids."""
    lru = list(itertools.islice(pool.free_block_ids, want))
    return lru[0] if len(lru) == want and lru == list(range(lru[0], lru[0] + want)) else None


def cheapest_stretch(pool: FreeBlockPool, want: int) -> int | None:
    """First id of `want` consecutive free blocks holding hardly more cached blocks than the `want` least
    recently freed do, with the least sum of LRU positions over its cached blocks; None if there is none."""
    free = pool.free_block_ids
    if want > len(free) or want < 1:
        return None
    n = pool.num_blocks
    order = np.fromiter(free, dtype=np.int64, count=len(free))
    cached_in_order = pool.cached_mask[order]
    in_use = np.ones(n, dtype=np.int64)
    in_use[order] = 0
    cached = np.zeros(n, dtype=np.int64)
    cached[order] = cached_in_order
    rank = np.zeros(n, dtype=np.int64)
    rank[order] = np.where(cached_in_order, np.arange(1, len(order) + 1), 0)

    def window_sums(values: np.ndarray) -> np.ndarray:
        sums = np.concatenate(([0], np.cumsum(values)))
        return sums[want:] - sums[:-want]

    allowed = int(cached_in_order[:want].sum()) + want // EVICTION_SLACK
    fits = (window_sums(in_use) == 0) & (window_sums(cached) <= allowed)
    if not fits.any():
        return None
    cost = np.where(fits, window_sums(rank), np.iinfo(np.int64).max)
    return int(np.argmin(cost))
