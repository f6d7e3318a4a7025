"""Expert alignment: the (token, slot) pairs sorted by expert and padded to whole row blocks.

The grouped GEMM runs one program per block of `block_m` rows that all use one expert, so each
expert's pairs are laid out contiguously and padded up to a multiple of `block_m`:

    sorted_pair_ids [max_blocks * block_m]  pair index t * top_k + j, or `num_pairs` for padding
    block_expert    [max_blocks]            the expert of each block (E past the last block)
    num_blocks      [1]                     blocks in use

One program computes all three with no host round trip and no atomics (so it can be captured
in a CUDA graph and is deterministic): per-expert counts, then each pair's rank among the pairs
of its expert before it, from one-hot sums over chunks of pairs. The bound on blocks depends
only on the pair count, so the grids launched after it are fixed by the batch shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PAIRS_PER_CHUNK = 64


@dataclass(frozen=True)
class AlignedPairs:
    sorted_pair_ids: torch.Tensor   # int32 [max_blocks * block_m]
    block_expert: torch.Tensor      # int32 [max_blocks]
    num_blocks: torch.Tensor        # int32 [1]

    @property
    def max_blocks(self) -> int:
        return int(self.block_expert.numel())


def max_aligned_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most blocks any routing of `num_pairs` pairs can need: each expert with pairs adds at most
    one partly filled block to the full ones."""
    return num_pairs // block_m + min(num_pairs, num_experts)


@triton.jit
def _align_kernel(IDS, SORTED, BLOCK_EXPERT, NUM_BLOCKS, num_pairs, E, max_blocks,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr):
    experts = tl.arange(0, BLOCK_E)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(IDS + start + lanes, mask=start + lanes < num_pairs, other=BLOCK_E)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, axis=0)
    block_start = block_end - blocks
    tl.store(NUM_BLOCKS, tl.sum(blocks, axis=0))
    # Each block's expert: how many experts' block ranges end at or before it.
    rows = tl.arange(0, BLOCK_M)
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        in_range = b < max_blocks
        owner = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(BLOCK_EXPERT + b, tl.minimum(owner, E), mask=in_range)
        # Padding rows: the slots of a block past its expert's count (every slot past the last block).
        own = owner[:, None] == experts[None, :]
        first_slot = tl.sum(tl.where(own, block_start[None, :], 0), axis=1) * BLOCK_M
        filled = tl.sum(tl.where(own, counts[None, :], 0), axis=1)
        slot = b[:, None] * BLOCK_M + rows[None, :]
        pad = (slot - first_slot[:, None] >= filled[:, None]) | (owner[:, None] >= E)
        tl.store(SORTED + slot, num_pairs, mask=pad & in_range[:, None])
    # Real rows: pair p of expert e goes to its expert's first slot plus its rank among e's pairs.
    cursor = block_start * BLOCK_M
    earlier = lanes[None, :] < lanes[:, None]
    for start in range(0, num_pairs, CHUNK):
        live = start + lanes < num_pairs
        ids = tl.load(IDS + start + lanes, mask=live, other=BLOCK_E)
        onehot = ids[:, None] == experts[None, :]
        base = tl.sum(tl.where(onehot, cursor[None, :], 0), axis=1)
        same = (ids[:, None] == ids[None, :]) & earlier
        rank = tl.sum(same.to(tl.int32), axis=1)
        tl.store(SORTED + base + rank, start + lanes, mask=live)
        cursor += tl.sum(onehot.to(tl.int32), axis=0)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """topk_ids [M, k] (int32) -> the pairs grouped by expert in blocks of `block_m` rows."""
    num_pairs = topk_ids.numel()
    max_blocks = max_aligned_blocks(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=device)
    _align_kernel[(1,)](topk_ids.reshape(-1), sorted_ids, block_expert, num_blocks, num_pairs, num_experts,
                        max_blocks, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts),
                        CHUNK=PAIRS_PER_CHUNK, BLOCK_B=32, num_warps=4)
    return AlignedPairs(sorted_ids, block_expert, num_blocks)
