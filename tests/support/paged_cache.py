"""Block tables for kernel tests: each sequence's pages drawn from a shuffled pool (non-monotonic,
never shared), padded with one spare column."""
from __future__ import annotations

import torch


def shuffled_tables(pages_per_seq: list[int], num_blocks: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [len(pages_per_seq), max + 1] tables over `num_blocks` pages in a random order."""
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = torch.zeros(len(pages_per_seq), max(pages_per_seq) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        tables[b, :n] = perm[used:used + n]
        used += n
    return tables
