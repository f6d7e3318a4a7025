"""The one interface every attention backend implements (dense kernels, FFD, the torch reference).

The engine asks it for the page size and the cache layout at startup and hands it the allocated
K/V pages with their `KVCacheSpec`. Every step, graph replays included, it calls `prepare_pages`
(host bookkeeping of the pages the step writes); a step that runs eagerly or is captured into a
graph then gets its `plan` (the kernels' host work for the step's shape, once for all layers),
which the step's metadata carries. The block manager gives it the pages it frees. Each
`Attention` layer calls `store` (or RoPE's fused write, then `post_store`) and then `decode` or
`prefill` with its own layer index.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING

import torch

from engine.attention.kv_cache_spec import KVCacheSpec
from engine.attention.kv_scales import KVScales
from engine.attention.metadata import AttentionMetadata, AttentionPlan, StepShape

if TYPE_CHECKING:
    from engine.request.sequence import Sequence


class AttentionBackend(abc.ABC):
    """KV store, decode and prefill over paged K/V, and the cache bookkeeping they need.

    `fuse_rope_store`: `store` is the plain cache write, so the layer may rotate k and store it
    with v in one launch (`RotaryFn.rotate_and_store`, on a GPU) and then call `post_store`.
    """

    name: str            # what runs, shown at startup and in /metrics
    variant: str         # the algorithm family: "reference", "standard", "flash", "fdpp", "ffd", "auto"
    fuse_rope_store: bool = False
    kv_scales: KVScales | None = None   # FP8 pages' per-(layer, KV head) scales, set by `allocate`
    prefill_prefix_keys: int = 0        # a chunk over this many cached keys takes a path of its own (0: none)

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

    def allocate(self, spec: KVCacheSpec, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:  # noqa: B027
        """The allocated K [layers, key pages, BS, Hkv, D] and V [layers, pages, BS, Hkv, D] pages of
        `spec`, whose query heads and dtypes the step plans are made for (a no-op by default; a
        backend that reads FP8 pages sets `kv_scales` here)."""

    def release(self, pages: list[int]) -> None:  # noqa: B027 - a backend without page state ignores it
        """The block manager freed these pages."""

    def decode_graph_widths(self, max_blocks: int) -> list[int]:
        """Block-table widths (pages), ascending and ending at `max_blocks`, to capture a decode
        graph for each: a backend whose host-side choice depends on the table width (FFD's "auto")
        names the widths where that choice changes."""
        return [max_blocks]

    # ----- per step (model runner) -------------------------------------------------------------
    def prepare_pages(self, seqs: list[Sequence]) -> None:  # noqa: B027 - most backends keep no page state
        """Before every step's forward over `seqs`, graph replays included: host bookkeeping of the
        pages the step writes (FFD's compact exact-K pool)."""

    def plan(self, shape: StepShape) -> AttentionPlan:
        """The kernels' host work for a step of `shape` that runs eagerly or is captured into a CUDA
        graph (which keeps it): split counts, grids, workspaces, shared by every layer of the step."""
        return AttentionPlan()

    # ----- per layer (the Attention layer) -----------------------------------------------------
    @abc.abstractmethod
    def store(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write key/value [T, Hkv, D] into this layer's pages at `slot_mapping` (-1 skips)."""

    def post_store(self, layer_idx: int, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:  # noqa: B027
        """After RoPE's fused K/V write (`fuse_rope_store`) of the rows at `slot_mapping` (a no-op by default)."""

    @abc.abstractmethod
    def decode(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        """q [B, Hq, D], one new token per sequence -> out [B, Hq, D] under `metadata.plan`; counters go
        to `metadata.counters`."""

    @abc.abstractmethod
    def prefill(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        """q [T, Hq, D] of any step with prefill chunks -> out [T, Hq, D] (causal over the pages)."""
