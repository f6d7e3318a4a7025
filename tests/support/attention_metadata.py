"""`AttentionMetadata` for calling a backend's `decode` / `prefill` directly in tests: only what the
kernels read (block tables, context lengths, query offsets, counters) is filled in; `planned` adds the
backend's plan for the step, as the model runner does once per step, and `cache_spec` describes a
test's cache for `AttentionBackend.allocate`."""
from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.kv_cache_spec import KVCacheSpec
from engine.attention.metadata import AttentionCounters, AttentionMetadata


def kernel_metadata(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None = None,
                    counters: AttentionCounters | None = None) -> AttentionMetadata:
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


def planned(backend: AttentionBackend, metadata: AttentionMetadata) -> AttentionMetadata:
    """`metadata` carrying `backend`'s plan for its step."""
    metadata.plan = backend.plan(metadata.step_shape)
    return metadata


def cache_spec(v_cache: torch.Tensor, num_heads: int, dtype: torch.dtype | None = None) -> KVCacheSpec:
    """The spec of V pages [layers, pages, BS, Hkv, D] read by layers of `num_heads` query heads of `dtype`
    (default the pages')."""
    num_layers, _, block_size, num_kv_heads, head_dim = v_cache.shape
    model_dtype = dtype or v_cache.dtype
    return KVCacheSpec(num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=model_dtype,
                       cache_dtype=None if v_cache.dtype == model_dtype else v_cache.dtype)
