"""The shape of the paged KV cache, which the model runner allocates and the backends size and plan for."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCacheSpec:
    """Pages [num_layers, pages, block_size, num_kv_heads, head_dim] of `dtype`, read by attention
    layers of `num_heads` query heads whose queries are `dtype` too (what a decode plan is made for)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one page over all layers."""
        element = torch.finfo(self.dtype).bits // 8
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element
