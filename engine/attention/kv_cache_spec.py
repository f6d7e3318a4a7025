"""The shape of the paged KV cache, which the model runner allocates and the backends size."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one page over all layers."""
        element = torch.finfo(self.dtype).bits // 8
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element
