"""A sequence's pages as runs of consecutive block ids, and a run read in place.

The block manager hands out blocks in order, so a sequence's pages are usually one run; in the NHD
layout a run of pages is a strided [tokens, Hkv, D] view of the cache, no copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PageRun:
    """Consecutive pages [first_block, first_block + num_blocks) holding `num_tokens` tokens."""

    first_block: int
    num_blocks: int
    num_tokens: int


def page_runs(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> list[list[PageRun]]:
    """Each sequence's first seq_lens[b] tokens as runs of consecutive block ids (host tensors)."""
    runs: list[list[PageRun]] = []
    for b, length in enumerate(seq_lens.tolist()):
        num_pages = (length + block_size - 1) // block_size
        if num_pages == 0:
            runs.append([])
            continue
        table = block_tables[b, :num_pages].long()
        breaks = ((table[1:] - table[:-1]) != 1).nonzero().flatten().add_(1).tolist()
        starts = [0, *breaks]
        ends = [*breaks, num_pages]
        first_blocks = table[starts].tolist()
        runs.append([PageRun(first, end - start, min(end * block_size, length) - start * block_size)
                     for first, start, end in zip(first_blocks, starts, ends, strict=True)])
    return runs


def run_view(cache: torch.Tensor, run: PageRun) -> torch.Tensor:
    """The run's tokens as a [num_tokens, Hkv, D] view of the pages (no copy)."""
    pages = cache[run.first_block:run.first_block + run.num_blocks]
    return pages.view(-1, *cache.shape[2:])[:run.num_tokens]
