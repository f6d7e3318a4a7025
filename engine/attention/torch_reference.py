"""The torch reference backend: one-pass decode, causal prefill and the KV store in plain torch.

Tests and tools compare against it; `fuse_rope_store = True` routes the layer through RoPE's
fused K/V write (a Triton kernel, run by the interpreter on a CPU) with everything else unchanged.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.kv_cache_spec import KVCacheSpec
from kernels.attention import reference
from kernels.attention.kv_quant import is_fp8

if TYPE_CHECKING:
    from engine.attention.metadata import AttentionMetadata


class ReferenceBackend(AttentionBackend):
    variant = "reference"

    def __init__(self, name: str = "reference", *, fuse_rope_store: bool = False) -> None:
        self.name = name
        self.fuse_rope_store = fuse_rope_store

    def allocate(self, spec: KVCacheSpec, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        if is_fp8(spec.kv_dtype):   # FP8 pages on the CPU: DenseBackend with [backend] cpu_attention
            raise ValueError(f"{type(self).__name__} reads pages of the model dtype, not {spec.kv_dtype}")

    def store(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        reference.store_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    def decode(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        return reference.decode_attention_ref(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                              scale=scale)

    def prefill(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        return reference.prefill_attention_ref(q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens,
                                               metadata.query_start_loc, scale=scale)
