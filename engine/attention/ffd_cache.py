"""The quantized key cache of `kernel = "ffd"`: per layer, keyed by KV page id.

A KV page is one quantization block (the engine sets the page size to `ffd_block_size`), so the
2-bit codes, per-channel scales and FP8 residual of a page live at the same page id as its V. A
page is quantized from its exact keys when its last row is written, whatever wrote it
(first-turn prefill, a prefill chunk, a decode step, a recompute after preemption); a prefix-cache
hit shares the page id and therefore its quantized keys too. Values are never quantized: the
kernels read them from the regular V pages. The newest, not yet full page is read exactly.

Memory: with `kernel = "ffd"` the exact keys of a page live only while the page is being filled
(`ExactKeyPages`: a small pool of K pages, page -> pool page), since everything after it reads
the quantized keys; per token and KV head at D = 128 in bf16 that is 256 B of V plus 32 B of
codes, 128 B of residual and 512/BS B of scales (~420 B at BS = 128, against 512 dense), plus the
pool. `kernel = "auto"` keeps every exact K page (the dense path below its crossover reads them):
~676 B. Decode reads 36 B per token plus 384 B per token of kept blocks either way.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kernels.ffd.reference import FP8, QuantizedPages


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


def exact_pool_pages(max_num_seqs: int, max_num_batched_tokens: int, block_size: int) -> int:
    """Pool pages that can be in use at once. When a step starts, the pages filled by the step before
    are given back first; then each running sequence holds at most its partial page (<= S), and the
    step's writes take new pages: a chunk of n tokens touches ceil((offset + n) / BS) pages, the
    first of them its partial page when offset > 0, so at most ceil(n / BS) <= n / BS + 1 new ones,
    and over the step at most T / BS + S. Peak: T / BS + 2 S."""
    return math.ceil(max_num_batched_tokens / block_size) + 2 * max_num_seqs


class ExactKeyPages:
    """Which K pool page holds the exact keys of each KV page being filled (host bookkeeping and
    the device map `key_page_map` [N] int32, -1 = none) for the compact K cache of kernel = "ffd".

    A page gets a pool page when a step first writes it and gives it back the step after the one
    that wrote its last row (it is quantized by then, and the next step's launches follow that
    step's on the stream), or when the block manager frees it. Pool pages are never shared, and
    a page is always written from row 0 onward by one sequence, so no row is read that its owner
    did not write. The full layout ("auto") has no pool: every page is its own K page.
    """

    def __init__(self, num_pages: int, pool_pages: int, device: torch.device) -> None:
        self.device = device
        self.key_page_map = torch.full((num_pages,), -1, dtype=torch.int32, device=device)
        self.pool_pages = pool_pages
        self.free = list(range(self.pool_pages - 1, -1, -1))   # a stack: low pool pages first
        self.owner: dict[int, int] = {}                         # KV page -> pool page
        self.filled_last_step: list[int] = []

    @property
    def num_in_use(self) -> int:
        return len(self.owner)

    def begin_step(self, written: Iterable[int], filled: Iterable[int]) -> None:
        """Before a step that writes rows of the pages `written`, the last row of those in `filled`."""
        updates: dict[int, int] = {}
        self._release(self.filled_last_step, updates)
        for page in written:
            if page not in self.owner:
                if not self.free:
                    raise RuntimeError(f"FFD: all {self.pool_pages} exact key pages are in use; the pool is sized "
                                       "from max_num_seqs and max_num_batched_tokens, so this is a bug")
                self.owner[page] = updates[page] = self.free.pop()
        self.filled_last_step = list(filled)
        self._push(updates)

    def release(self, pages: Iterable[int]) -> None:
        """The block manager freed these pages (finished, aborted or preempted sequences)."""
        updates: dict[int, int] = {}
        self._release(pages, updates)
        self._push(updates)

    def _release(self, pages: Iterable[int], updates: dict[int, int]) -> None:
        for page in pages:
            pool_page = self.owner.pop(page, None)
            if pool_page is not None:
                self.free.append(pool_page)
                updates[page] = -1

    def _push(self, updates: dict[int, int]) -> None:
        if not updates:
            return
        pin = self.device.type == "cuda"
        idx = torch.tensor(list(updates), dtype=torch.long, pin_memory=pin)
        val = torch.tensor(list(updates.values()), dtype=torch.int32, pin_memory=pin)
        # stream-ordered after every launch so far: no step in flight sees the change
        self.key_page_map[idx.to(self.device, non_blocking=True)] = val.to(self.device, non_blocking=True)
