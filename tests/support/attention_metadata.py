"""`AttentionMetadata` for calling a backend's `decode` / `prefill` directly in tests: only what the
kernels read (block tables, context lengths, query offsets, counters) is filled in."""
from __future__ import annotations

import torch

from engine.attention.layer import AttentionMetadata


def kernel_metadata(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None = None,
                    counters: dict[str, float] | None = None) -> AttentionMetadata:
    """Decode metadata (one token per sequence) unless `query_start_loc` gives prefill chunks."""
    dev = seq_lens.device
    if query_start_loc is None:
        query_start_loc = torch.arange(seq_lens.shape[0] + 1, dtype=torch.int32, device=dev)
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    num_tokens = int(query_start_loc[-1])
    return AttentionMetadata(positions=torch.zeros(num_tokens, dtype=torch.long, device=dev),
                             slot_mapping=torch.full((num_tokens,), -1, dtype=torch.long, device=dev),
                             query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
                             max_query_len=max(query_lens), is_decode_only=all(n == 1 for n in query_lens),
                             counters={} if counters is None else counters)
