"""Block tables for kernel tests: each sequence's pages drawn from a shuffled pool (non-monotonic,
never shared), padded with one spare column."""
from __future__ import annotations

from collections.abc import Callable

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


def paged_prefill_inputs(lens: list[int], q_lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int,
                         dtype: torch.dtype, seed: int = 0, q_dtype: torch.dtype | None = None
                         ) -> tuple[torch.Tensor, ...]:
    """(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc) of a prefill step: fresh random pages in
    `dtype` under shuffled tables, NaN in every slot no sequence owns (the rest of a last page, unused pages),
    each sequence's last q_lens[b] tokens as its new rows; q in `q_dtype` (default `dtype`)."""
    gen = torch.Generator().manual_seed(seed)
    pages = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(pages) + 2
    k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    used = 0
    for b, (n, count) in enumerate(zip(lens, pages, strict=True)):
        tables[b, :count] = order[used:used + count].int()
        used += count
        if n % block_size:
            last = int(tables[b, count - 1])
            k[last, n % block_size:] = float("nan")
            v[last, n % block_size:] = float("nan")
    for block in order[used:]:
        k[block] = float("nan")
        v[block] = float("nan")
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(q_dtype or dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32), starts


def prefill_in_chunks(prefill: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      tables: torch.Tensor, ends: list[int], scale: float) -> torch.Tensor:
    """One sequence's prompt q[T, H, D] through `prefill` a chunk at a time, each chunk ending at the next of
    `ends` (the last is T) after the ones before it, its rows concatenated."""
    pieces: list[torch.Tensor] = []
    begin = 0
    for end in ends:
        pieces.append(prefill(q[begin:end], k, v, tables, torch.tensor([end], dtype=torch.int32),
                              torch.tensor([0, end - begin], dtype=torch.int32), scale=scale))
        begin = end
    return torch.cat(pieces)
