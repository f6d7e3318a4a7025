"""The one interface every attention backend implements (dense kernels, FFD, the torch reference).

The engine asks it for the page size and the cache layout at startup, hands it the allocated
K/V pages, calls `plan` once per step before the forward, and gives it the pages the block
manager frees; each `Attention` layer calls `store` (or RoPE's fused write, then `post_store`)
and then `decode` or `prefill` with its own layer index.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention.kv_cache_spec import KVCacheSpec

if TYPE_CHECKING:
    from engine.attention.layer import AttentionMetadata
    from engine.request.sequence import Sequence


@dataclass
class AttentionPlan:
    """What a backend decided on the host for one step, read by its kernels through the step's
    metadata (`AttentionMetadata.plan`); empty where a backend decides nothing per step."""


class AttentionBackend(abc.ABC):
    """KV store, decode and prefill over paged K/V, and the cache bookkeeping they need.

    `fuse_rope_store`: `store` is the plain cache write, so the layer may rotate k and store it
    with v in one launch (`RotaryFn.rotate_and_store`, on a GPU) and then call `post_store`.
    """

    name: str            # what runs, shown at startup and in /metrics
    variant: str         # the algorithm family: "reference", "standard", "flash", "fdpp", "ffd", "auto"
    fuse_rope_store: bool = False

    # ----- cache (engine and model runner, at startup) -----------------------------------------
    def page_size(self, configured: int) -> int:
        """Tokens per KV page, given `[backend] block_size`."""
        return configured

    def cache_layout(self, spec: KVCacheSpec, budget_bytes: int) -> tuple[int, int]:
        """(bytes per KV page, fixed bytes) of the cache that `budget_bytes` is split into."""
        return spec.bytes_per_block, 0

    def key_cache_pages(self, num_blocks: int) -> int:
        """K pages to allocate for `num_blocks` KV pages."""
        return num_blocks

    def allocate(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """The allocated K [layers, key pages, BS, Hkv, D] and V [layers, pages, BS, Hkv, D] pages."""

    def release(self, pages: list[int]) -> None:
        """The block manager freed these pages."""

    def decode_graph_widths(self, max_blocks: int) -> list[int]:
        """Block-table widths (pages), ascending and ending at `max_blocks`, to capture a decode
        graph for each: a backend whose host-side choice depends on the table width (FFD's "auto")
        names the widths where that choice changes."""
        return [max_blocks]

    # ----- per step (model runner) -------------------------------------------------------------
    def plan(self, seqs: list[Sequence]) -> AttentionPlan:
        """Before a step's forward over `seqs` (empty for a CUDA-graph capture's dummy rows, which
        write no K/V): host-side bookkeeping, and the plan the step's metadata carries."""
        return AttentionPlan()

    # ----- per layer (the Attention layer) -----------------------------------------------------
    @abc.abstractmethod
    def store(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write key/value [T, Hkv, D] into this layer's pages at `slot_mapping` (-1 skips)."""

    def post_store(self, layer_idx: int, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """After RoPE's fused K/V write (`fuse_rope_store`) of the rows at `slot_mapping`."""

    @abc.abstractmethod
    def decode(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        """q [B, Hq, D], one new token per sequence -> out [B, Hq, D]; counters go to `metadata.counters`."""

    @abc.abstractmethod
    def prefill(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        """q [T, Hq, D] of any step with prefill chunks -> out [T, Hq, D] (causal over the pages)."""
