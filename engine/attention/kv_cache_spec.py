"""The shape of the paged KV cache, which the model runner allocates and the backends size and plan for."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCacheSpec:
    """Pages [num_layers, pages, block_size, num_kv_heads, head_dim] of `kv_dtype` (`cache_dtype`, by
    default the model's `dtype`), read by attention layers of `num_heads` query heads whose queries
    are `dtype` (what a decode plan is made for)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    cache_dtype: torch.dtype | None = None

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.dtype if self.cache_dtype is None else self.cache_dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one page over all layers."""
        element = torch.finfo(self.kv_dtype).bits // 8
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element
