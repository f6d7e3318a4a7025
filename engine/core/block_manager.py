"""Paged KV cache bookkeeping: fixed-size blocks, reference counts and prefix caching.

A full block is identified by a hash chain: hash(parent block's hash, its token ids). A new
sequence reuses every leading full block whose hash is known and whose tokens match (verified,
so a hash collision can never serve wrong K/V). Freed blocks keep their contents and hash and
stay findable until a new allocation takes them (lazy eviction, least recently freed first).

A long prompt's chunks take their blocks as one run of consecutive ids where the free blocks allow
(`place_run`): a run of pages is one contiguous view of the cache, which the GPU prefill's cuDNN prefix
reads in place instead of gathering.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import xxhash

from engine.core.run_placement import place_run
from engine.request.sequence import Sequence

NO_HASH = -1
# Prompts of at least this many tokens get their blocks as one run of ids (`place_run`).
LONG_PROMPT_TOKENS = 4096


def hash_block(parent_hash: int, token_ids: list[int]) -> int:
    hasher = xxhash.xxh64(parent_hash.to_bytes(8, "little", signed=True))
    hasher.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return hasher.intdigest() & 0x7FFF_FFFF_FFFF_FFFF


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int = NO_HASH
    token_ids: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 on_free: Callable[[list[int]], None] | None = None,
                 long_prompt_tokens: int = LONG_PROMPT_TOKENS) -> None:
        """`on_free`: told the blocks whose last reference a `free` dropped (FFD's exact K pool).
        `long_prompt_tokens`: sequences at least this long take their prefill chunks' blocks as runs."""
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order = order of freeing; allocation takes the oldest (LRU eviction).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block_id: dict[int, int] = {}
        self.cached_mask = np.zeros(num_blocks, dtype=bool)   # blocks with a hash: `place_run` reads it whole
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.on_free = on_free
        self.long_prompt_tokens = long_prompt_tokens

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def _take_free_block(self) -> int:
        block_id = next(iter(self.free_block_ids))
        self.claim(block_id)
        return block_id

    def claim(self, block_id: int) -> None:
        """Take free block `block_id` for a sequence (its cached contents, if any, are evicted)."""
        del self.free_block_ids[block_id]
        block = self.blocks[block_id]
        if block.hash != NO_HASH and self.hash_to_block_id.get(block.hash) == block_id:
            del self.hash_to_block_id[block.hash]
        block.hash, block.token_ids, block.ref_count = NO_HASH, [], 1
        self.cached_mask[block_id] = False

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Attach the leading cached full blocks of a sequence that owns no blocks yet.

        At least one token is always left to compute, so the step that finishes the prompt
        has a position to sample from. Returns the number of tokens reused.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:   # those need every position's logits
            return 0
        max_blocks = (len(seq) - 1) // self.block_size
        self.prefix_cache_queries += max_blocks * self.block_size
        parent = NO_HASH
        for i in range(max_blocks):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            parent = hash_block(parent, tokens)
            block_id = self.hash_to_block_id.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        reused = len(seq.block_table) * self.block_size
        seq.num_computed_tokens = reused
        seq.num_cached_tokens = reused
        self.prefix_cache_hits += reused
        return reused

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` enough blocks to hold `num_new_tokens` more computed tokens."""
        needed = self.blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError("allocate_slots called without can_allocate")
        prefilling = num_new_tokens > 1 or seq.num_output_tokens == 0   # not a decode step's one token
        if needed and prefilling and len(seq) >= self.long_prompt_tokens:
            placed = place_run(self, seq, needed)
            if placed is not None:
                for block_id in placed:
                    self.claim(block_id)
                seq.block_table.extend(placed)
                return
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of blocks whose tokens are all computed, so later requests reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = seq.num_hashed_blocks   # blocks before it are published: each step hashes only new ones
        parent = self.blocks[seq.block_table[start - 1]].hash if start else NO_HASH
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash == NO_HASH:
                tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
                block.hash = hash_block(parent, tokens)
                block.token_ids = list(tokens)
                self.cached_mask[block.block_id] = True
                self.hash_to_block_id.setdefault(block.hash, block.block_id)
            parent = block.hash
        seq.num_hashed_blocks = max(start, num_full)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; blocks that reach zero become reusable (tail first)."""
        released = []
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
                released.append(block_id)
        if self.on_free is not None and released:
            self.on_free(released)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
