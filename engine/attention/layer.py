"""The one attention layer every model calls and the per-step metadata it reads.

The model runner builds an `AttentionMetadata` once per step and installs it with
`forward_context(...)`; every `Attention` layer then reads it, writes the step's new K/V into
its pages (by `slot_mapping`) and attends through the step's `AttentionBackend`: a decode-only
step calls its `decode`, any step with prefill chunks its `prefill`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.metadata import AttentionMetadata, OutputRows


class RotaryFn(Protocol):
    """A rotary embedding (`engine.model.layers.RotaryEmbedding`): rotate, or rotate and store k/v."""

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotate_and_store(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                         k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None
                         ) -> torch.Tensor: ...


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    backend: AttentionBackend


_context: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(metadata: AttentionMetadata, backend: AttentionBackend) -> Iterator[None]:
    global _context
    previous, _context = _context, ForwardContext(metadata, backend)
    try:
        yield
    finally:
        _context = previous


def step_is_decode_only() -> bool | None:
    """Whether the step being run holds only decode tokens; None outside a model step."""
    return None if _context is None else _context.metadata.is_decode_only


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("Attention called outside forward_context(); the model runner sets it")
    return _context


class Attention(nn.Module):
    """Paged attention over this layer's KV cache (set by the model runner after allocation)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 layer_idx: int) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: RotaryFn | None = None,
                positions: torch.Tensor | None = None, rows: OutputRows | None = None) -> torch.Tensor:
        """q[T, Hq*D], k/v[T, Hkv*D] -> out[T, Hq*D]; with `rotary`, q and k are rotated at
        `positions` first (fused with the KV store where the backend allows it). With `rows`, every
        row's K/V is stored but only those rows attend: out[N, Hq*D]."""
        ctx = get_forward_context()
        meta = ctx.metadata
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError(f"KV cache not allocated for attention layer {self.layer_idx}")
        num_tokens = q.shape[0]
        backend = ctx.backend
        fused = False
        if rotary is not None:
            if positions is None:
                raise ValueError("Attention: rotary needs positions")
            scales = backend.kv_scales   # FP8 pages: the fused write quantizes with the layer's scales
            fused = backend.fuse_rope_store and (self.k_cache.dtype == k.dtype or scales is not None)
            if fused:
                k_scale, v_scale = (None, None) if scales is None else (scales.k[self.layer_idx],
                                                                        scales.v[self.layer_idx])
                q = rotary.rotate_and_store(positions, q, k, v, self.k_cache, self.v_cache, meta.slot_mapping,
                                            k_scale, v_scale)
                backend.post_store(self.layer_idx, self.k_cache, meta.slot_mapping)
            else:
                q, k = rotary(positions, q, k)
        if not fused:
            backend.store(self.layer_idx, k.view(num_tokens, self.num_kv_heads, self.head_dim),
                          v.view(num_tokens, self.num_kv_heads, self.head_dim),
                          self.k_cache, self.v_cache, meta.slot_mapping)
        if rows is not None:
            if rows.metadata is None:
                return q.new_empty((0, self.num_heads * self.head_dim))
            q, meta = q[rows.index], rows.metadata
            num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        if meta.is_decode_only:
            out = backend.decode(self.layer_idx, q, self.k_cache, self.v_cache, meta, scale=self.scale)
        else:
            out = backend.prefill(self.layer_idx, q, self.k_cache, self.v_cache, meta, scale=self.scale)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
