"""The quantized key cache of `kernel = "ffd"`: per layer, keyed by KV page id.

A KV page is one quantization block (the engine sets the page size to `ffd_block_size`), so the
2-bit codes, per-channel scales and FP8 residual of a page live at the same page id as its exact
K/V. A page is quantized from its exact keys when its last row is written, whatever wrote it
(first-turn prefill, a prefill chunk, a decode step, a recompute after preemption); a prefix-cache
hit shares the page id and therefore its quantized keys too. Values are never quantized: the
kernels read them from the regular V pages. The newest, not yet full page is read exactly.

Memory, honestly: this first version keeps the exact K pages as well (the exact tail, prefill
and the quantizer read them). FFD therefore costs more memory than dense attention, not less:
per token and KV head at D = 128 in bf16, 512 B of exact K/V plus 32 B of codes, 128 B of
residual and 512/BS B of scales (~676 B at BS = 128 vs 512). What it saves is decode read
bandwidth: 36 B per token plus 384 B per token of kept blocks, instead of 512 B.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ffd_reference import FP8, QuantizedPages


@dataclass(frozen=True)
class FFDCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def __post_init__(self) -> None:
        if self.head_dim % 4:
            raise ValueError(f"FFD packs 4 two-bit codes per byte: head_dim {self.head_dim} "
                             "is not a multiple of 4")

    @property
    def bytes_per_block(self) -> int:
        """Quantized-key bytes of one page over all layers (codes + fp32 scales + fp8 residual)."""
        per_head = self.block_size * self.head_dim // 4 + 4 * self.head_dim + self.block_size * self.head_dim
        return self.num_layers * self.num_kv_heads * per_head


class FFDKeyCache:
    """codes [layers, N, Hkv, BS, D/4] u8, scales [layers, N, Hkv, D] f32, residual [..., BS, D] fp8."""

    def __init__(self, spec: FFDCacheSpec, num_blocks: int, device: torch.device) -> None:
        s = spec
        self.spec = spec
        self.num_blocks = num_blocks
        self.codes = torch.zeros(s.num_layers, num_blocks, s.num_kv_heads, s.block_size, s.head_dim // 4,
                                 dtype=torch.uint8, device=device)
        self.scales = torch.zeros(s.num_layers, num_blocks, s.num_kv_heads, s.head_dim,
                                  dtype=torch.float32, device=device)
        self.residual = torch.zeros(s.num_layers, num_blocks, s.num_kv_heads, s.block_size, s.head_dim,
                                    dtype=FP8, device=device)

    def layer(self, index: int) -> QuantizedPages:
        return QuantizedPages(self.codes[index], self.scales[index], self.residual[index])
