"""`[flashdecoding] kernel = "ffd" | "auto"`: the Faster Flash Decoding attention backend.

Every attention call of every layer applies the per-query rule of `kernels/ffd/reference.py`
(2-bit scan, top-δ block selection against a pseudo-max from the sinks and the local window,
refined keys for kept blocks, exact tail), in decode and in prefill alike, so that chunked
prefill, prefix-cache hits, multi-turn and preemption/recompute all give what a cold run gives.

  where   decode                   prefill                          store K/V + quantize pages
  GPU     Triton (kernels/ffd/decode.py)  Triton (kernels/ffd/prefill.py)  Triton (store_kv + quantize)
  CPU     torch rule               torch rule                       torch

With every exact K page kept ("auto") the GPU's K/V write is RoPE's fused one (`post_store`
quantizes after it; H200, 4K, B = 1: 4.736 -> 4.677 ms/token end to end). The compact pool keeps
store_kv: the fused write through its page map gained nothing (bench/RESULTS.md).

"auto": queries whose context is shorter than a crossover length attend densely over the exact
keys (inside the same kernel: split-KV with log-sum-exp merge, i.e. Flash-Decoding), longer ones
use FFD. A step whose block table is too narrow for any row to reach the crossover runs the
Flash-Decoding backend itself (`dense`), decode and prefill: the FFD kernel's dense decode rows
cost its three launches (H200, 4K: 20.1 against 16.3 us at B = 1, 55.0 against 43.0 at B = 8).
Decode graphs are captured at that width too (`decode_graph_widths`), so short contexts replay
the Flash-Decoding graph. The crossover is per GPU, measured by `bench/ffd_kernels.py --crossover`
and stored in CROSSOVER_TOKENS; `[flashdecoding] ffd_crossover_tokens` overrides it (a GPU's own
measurement), and a device with neither is a startup error (never a guess). Where the measurement
found FFD never faster, "auto" builds the plain Flash-Decoding backend and says so at startup.

Sparsity counters (decode steps): `ffd_blocks_total` and `ffd_blocks_kept`, counted over
(KV head, full block) pairs, go into the step's `counters` (exported by /metrics); on the GPU
they are device tensors, added without a sync.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.attention.layer import AttentionBackend
from engine.attention.ffd_cache import ExactKeyPages, FFDCacheSpec, FFDKeyCache, exact_pool_pages
from engine.request.sequence import Sequence
from kernels.attention import reference
from kernels.ffd.reference import (
    FFDParams,
    QuantizedPages,
    ffd_decode_ref,
    ffd_prefill_ref,
    quantize_on_write_ref,
)

logger = logging.getLogger(__name__)

# GPU name (torch.cuda.get_device_name) -> the context length from which our FFD kernel (δ = 5
# nats, BS = 128) beats our dense Flash-Decoding kernel at batch 1 and 8, measured by
# `bench/ffd_kernels.py --crossover` (synthetic blocks at sparsity 0.76-0.80, 4K..128K tokens).
# None = measured, and FFD was never faster: "auto" then runs dense everywhere.
CROSSOVER_TOKENS: dict[str, int | None] = {
    # bench/results/ffd_kernels_fused_threshold.json ("crossover"), 2026-12-01: FFD faster at B = 8
    # from 8K and at B = 1 from 16K (27.6 vs 29.5 us; 8K: 24.7 vs 21.7); at 128K 2.29x (B = 1) and
    # 2.96x (B = 8). Re-measured after the attend's split minimum went to 1 (ffd_kernels_split_rule.json,
    # same day): still 16K (B = 1: 28.4 vs 29.6 us; 8K: 22.3 vs 21.5). Again with the int8 scan
    # (ffd_kernels_int8_scan.json, same day): 16K (B = 1: 28.2 vs 29.5 us; 8K: 22.8 vs 20.8).
    "NVIDIA H200": 16384,
}
NEVER = 2**31 - 1
COMPACT_TEXT = "exact keys only for pages being filled"
FULL_TEXT = "exact K kept for every page: saves read bandwidth, not memory"


def params_from_config(fd: Any, min_ffd_len: int = 0) -> FFDParams:
    return FFDParams(block_size=int(fd.ffd_block_size),
                     delta_log2=FFDParams.delta_to_log2(float(fd.delta), fd.delta_units),
                     sink_tokens=int(fd.sink_tokens), local_window=int(fd.local_window),
                     min_ffd_len=min_ffd_len)


def crossover_for(device: torch.device, configured: int | None = None) -> int:
    """`[flashdecoding] ffd_crossover_tokens` where set, else the length stored for this GPU."""
    if configured is not None:
        return configured
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    if name not in CROSSOVER_TOKENS:
        known = ", ".join(f"{k}: {v}" for k, v in CROSSOVER_TOKENS.items()) or "none"
        raise ValueError(f"[flashdecoding] kernel = \"auto\" needs a measured FFD crossover context length "
                         f"for {name!r} (stored: {known}): run `python bench/ffd_kernels.py --crossover` "
                         f"on this GPU and set [flashdecoding] ffd_crossover_tokens to the length it prints, "
                         f"or set kernel = \"ffd\" or \"flash\"")
    measured = CROSSOVER_TOKENS[name]
    return NEVER if measured is None else measured


def _check_gpu(device: torch.device, vendor: str) -> None:
    if vendor != "nvidia":
        raise ValueError(f"[flashdecoding] kernel = \"ffd\" has Triton kernels for NVIDIA only (FP8 E4M3 "
                         f"residuals); gpu_vendor is {vendor!r}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"[flashdecoding] kernel = \"ffd\" needs FP8 E4M3 (compute capability >= 8.9); "
                         f"this GPU is {major}.{minor}")


@dataclass
class FFDAttentionBackend(AttentionBackend):
    params: FFDParams | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    num_splits: int = 0
    triton: bool = False                                     # Triton store/decode (GPU; the interpreter in tests)
    cache: FFDKeyCache | None = None
    layer_of: dict[int, int] = field(default_factory=dict)   # K page tensor address -> layer
    compact: bool = False             # exact K only for pages being filled (kernel = "ffd"), see engine/attention/ffd_cache.py
    pool_pages: int = 0               # K pool size when compact (size_exact_pool)
    exact: ExactKeyPages | None = None
    sync: torch.Tensor | None = None  # the decode's counters, zero between calls (kernels.ffd.decode.ffd_sync_buffer)
    dense: AttentionBackend | None = None   # "auto": Flash-Decoding for steps with every row below the crossover

    @property
    def page_size(self) -> int:
        """The KV page size this backend needs: one quantization block."""
        assert self.params is not None
        return self.params.block_size

    # ----- cache (called by the engine and the model runner) ----------------------------------
    def size_exact_pool(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.pool_pages = exact_pool_pages(max_num_seqs, max_num_batched_tokens, self.page_size)

    def key_cache_pages(self, num_blocks: int) -> int:
        """K pages to allocate for `num_blocks` KV pages."""
        if not self.compact:
            return num_blocks
        if self.pool_pages <= 0:
            raise RuntimeError("FFD: size_exact_pool was not called before allocating the KV cache")
        return min(num_blocks, self.pool_pages)

    def cache_bytes(self, spec: Any, compact: bool | None = None) -> tuple[int, int]:
        """(bytes per KV page, fixed bytes) of this backend's cache: V pages and quantized keys, and
        exact K pages per page (full layout) or as a fixed pool (compact; default: the current
        layout). `spec`: engine KVCacheSpec."""
        quantized = FFDCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, self.page_size).bytes_per_block
        half = spec.bytes_per_block // 2                        # the K (or the V) pages of one KV page
        if self.compact if compact is None else compact:
            return half + quantized, half * self.key_cache_pages(1 << 62)
        return 2 * half + quantized, 0

    def plan_cache(self, spec: Any, budget_bytes: int) -> tuple[int, int]:
        """`cache_bytes` after choosing the layout that holds more pages in `budget_bytes`.

        The pool is sized for max_num_seqs partial pages; with many sequences allowed and a small
        budget (a CPU default: 256 sequences in 2 GB) it can cost more than the exact keys it
        saves, and kernel = "ffd" then keeps every exact K page instead (and says so)."""
        if self.compact:
            per_page, fixed = self.cache_bytes(spec)
            full_per_page, _ = self.cache_bytes(spec, compact=False)
            if (budget_bytes - fixed) // per_page <= budget_bytes // full_per_page:
                self.compact = False
                self.name = self.name.replace(COMPACT_TEXT, FULL_TEXT)
                logger.info("kernel = \"ffd\": a pool of %d exact K pages (max_num_seqs, max_num_batched_tokens) "
                            "would hold fewer pages in this KV budget than keeping every exact K page; keeping them",
                            self.pool_pages)
        return self.cache_bytes(spec)

    def allocate_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """K [layers, E, BS, Hkv, D] and V [layers, N, BS, Hkv, D] pages: allocate the quantized keys
        of the N pages and the page -> K page map."""
        num_layers, num_blocks, block_size, kv_heads, head_dim = v_cache.shape
        if block_size != self.page_size:
            raise ValueError(f"KV pages of {block_size} tokens; FFD needs pages of ffd_block_size = {self.page_size}")
        if k_cache.shape[1] != self.key_cache_pages(num_blocks):
            raise ValueError(f"FFD: {k_cache.shape[1]} K pages for {num_blocks} KV pages; "
                             f"expected {self.key_cache_pages(num_blocks)}")
        self.cache = FFDKeyCache(FFDCacheSpec(num_layers, kv_heads, head_dim, block_size), num_blocks, v_cache.device)
        self.exact = ExactKeyPages(num_blocks, k_cache.shape[1], v_cache.device) if self.compact else None
        self.layer_of = {k_cache[i].data_ptr(): i for i in range(num_layers)}
        # Every exact K page kept ("auto", or "ffd" that kept them): the layer may write K/V with RoPE in
        # one launch (kernels/fused.py), then `post_store` quantizes. Not through the pool's page map:
        # that gained nothing end to end (bench/RESULTS.md).
        self.fuse_rope_store = self.triton and self.exact is None

    def begin_step(self, seqs: list[Sequence]) -> None:
        """Before a forward: pool pages for the pages this step writes (compact K cache only)."""
        if self.exact is None:
            return
        bs = self.page_size
        written: list[int] = []
        filled: list[int] = []
        for seq in seqs:
            start = seq.num_computed_tokens
            end = start + seq.num_scheduled_tokens
            for j in range(start // bs, (end - 1) // bs + 1):
                written.append(seq.block_table[j])
                if (j + 1) * bs <= end:
                    filled.append(seq.block_table[j])
        self.exact.begin_step(written, filled)

    def release_pages(self, pages: list[int]) -> None:
        """The block manager freed these pages."""
        if self.exact is not None:
            self.exact.release(pages)

    def pages_of(self, k_cache: torch.Tensor) -> QuantizedPages:
        layer = self.layer_of.get(k_cache.data_ptr())
        if self.cache is None or layer is None:
            raise RuntimeError("FFD: this K cache has no quantized keys (allocate_cache was not called for it)")
        return self.cache.layer(layer)

    @property
    def dense_width(self) -> int:
        """"auto": the widest block table (pages) none of whose rows reaches the crossover (a row of a
        table W pages wide has at most W * page_size tokens, and is dense below min_ffd_len); 0 else."""
        if self.dense is None or self.params is None:
            return 0
        return (self.params.min_ffd_len - 1) // self.params.block_size

    def _dense_step(self, block_tables: torch.Tensor) -> bool:
        """"auto": no row of this step can reach the crossover, so it runs on the Flash-Decoding backend."""
        return self.dense is not None and block_tables.shape[1] <= self.dense_width

    def decode_graph_widths(self, max_blocks: int) -> list[int]:
        """Graphs at `dense_width` too (the Flash-Decoding backend), where it is narrower than the widest."""
        return [self.dense_width, max_blocks] if 0 < self.dense_width < max_blocks else [max_blocks]

    @property
    def key_page_map(self) -> torch.Tensor | None:
        """The page -> K page map the kernels take (None: the full layout, K page = page)."""
        return self.exact.key_page_map if self.exact is not None else None

    # ----- the three attention functions ---------------------------------------------------
    def _store(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        if self.triton:
            from kernels import store_kv
            store_kv(key, value, k_cache, v_cache, slot_mapping, self.key_page_map)
        else:
            reference.store_kv_ref(key, value, k_cache, v_cache, slot_mapping, self.key_page_map)
        self._quantize(k_cache, slot_mapping)

    def _quantize(self, k_cache, slot_mapping) -> None:
        """After a K/V write (the backend's own, or RoPE's fused one: `post_store`): quantize the
        blocks it filled."""
        pages = self.pages_of(k_cache)
        if self.triton:
            from kernels.ffd.quantize import quantize_on_write
            quantize_on_write(k_cache, pages.codes, pages.scales, pages.residual, slot_mapping, self.key_page_map)
        else:
            quantize_on_write_ref(k_cache, pages.codes, pages.scales, pages.residual, slot_mapping, self.key_page_map)

    def _decode(self, q, k_cache, v_cache, block_tables, seq_lens, *, scale, layer_idx, counters):
        if self._dense_step(block_tables):
            return self.dense.decode(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, layer_idx=layer_idx,
                                     counters=counters)
        pages = self.pages_of(k_cache)
        assert self.params is not None
        if self.triton:
            from kernels.ffd.decode import ffd_decode
            stats = torch.zeros(2, dtype=torch.int64, device=q.device)
            out = ffd_decode(q, k_cache, v_cache, pages.codes, pages.scales, pages.residual, block_tables,
                             seq_lens, scale=scale, params=self.params, num_splits=self.num_splits or None,
                             stats=stats, key_page_map=self.key_page_map,
                             sync=self._decode_sync(q.shape[0], k_cache.shape[2], q.device))
            counters["ffd_blocks_total"] = counters.get("ffd_blocks_total", 0.0) + stats[0]
            counters["ffd_blocks_kept"] = counters.get("ffd_blocks_kept", 0.0) + stats[1]
            return out
        return ffd_decode_ref(q, k_cache, v_cache, pages, block_tables, seq_lens, scale=scale,
                              params=self.params, stats=counters, key_page_map=self.key_page_map)

    def _decode_sync(self, batch: int, kv_heads: int, device: torch.device) -> torch.Tensor:
        """One counter buffer for every layer's decode (they run in stream order), grown with the batch;
        every call leaves it zero, so no memset per call."""
        from kernels.ffd.decode import ffd_sync_buffer, sync_entries
        if self.sync is None or self.sync.device != device or self.sync.numel() < sync_entries(batch, kv_heads):
            self.sync = ffd_sync_buffer(max(batch, 64), kv_heads, device)
        return self.sync

    def _prefill(self, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *, scale):
        if self._dense_step(block_tables):
            return self.dense.prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale=scale)
        assert self.params is not None
        pages = self.pages_of(k_cache)
        if self.triton:
            from kernels.ffd.prefill import ffd_prefill
            return ffd_prefill(q, k_cache, v_cache, pages.codes, pages.scales, pages.residual, block_tables,
                               seq_lens, query_start_loc, scale=scale, params=self.params,
                               key_page_map=self.key_page_map)
        return ffd_prefill_ref(q, k_cache, v_cache, pages, block_tables, seq_lens, query_start_loc, scale=scale,
                               params=self.params, key_page_map=self.key_page_map)


def make_ffd_backend(fd: Any, device: torch.device, vendor: str, *,
                     crossover: int | None = None) -> FFDAttentionBackend:
    """The backend for kernel = "ffd" or "auto" (`crossover` overrides the stored table: tests)."""
    if fd.kernel not in ("ffd", "auto"):
        raise ValueError(f"make_ffd_backend serves kernel = 'ffd' | 'auto', got {fd.kernel!r}")
    on_gpu = device.type == "cuda"
    if on_gpu:
        _check_gpu(device, vendor)
    min_len = 0
    if fd.kernel == "auto":
        min_len = crossover if crossover is not None else crossover_for(device, fd.ffd_crossover_tokens)
        if min_len >= NEVER:   # measured: FFD never wins here, so "auto" is plain Flash-Decoding
            from engine.attention.dense import make_attention_backend
            logger.info("[flashdecoding] kernel = \"auto\": FFD was never faster than Flash-Decoding on this GPU "
                        "when measured (engine/attention/ffd.py CROSSOVER_TOKENS); running kernel = \"flash\"")
            return make_attention_backend(fd.model_copy(update={"kernel": "flash"}), device, vendor)  # type: ignore
    params = params_from_config(fd, min_len)
    if params.sink_tokens == 0 and params.local_window == 0:
        logger.warning("[flashdecoding] sink_tokens = local_window = 0: no pseudo-max, so FFD keeps every block")
    units = f"δ = {fd.delta:g} ({'natural log' if fd.delta_units == 'e' else 'log2'} units, "
    units += f"{params.delta_log2:.3f} in log2)"
    where = "triton decode and prefill" if on_gpu else "torch reference (cpu)"
    mode = (f"auto: dense Flash-Decoding below {min_len} context tokens (steps with no row above: "
            f"the Flash-Decoding backend), FFD from there") if fd.kernel == "auto" else "FFD"
    compact = fd.kernel == "ffd"
    memory = COMPACT_TEXT if compact else FULL_TEXT
    name = (f"{where}: Faster Flash Decoding [{mode}] (2-bit keys + FP8 residual in blocks of "
            f"{params.block_size}, top-δ per GQA group, {units}, sinks {params.sink_tokens}, "
            f"local window {params.local_window}; {memory})")
    backend = FFDAttentionBackend(name=name, params=params, device=device, triton=on_gpu,
                                  num_splits=int(getattr(fd, "num_splits", 0) or 0), compact=compact)
    if fd.kernel == "auto":
        from engine.attention.dense import make_attention_backend
        flash = fd.model_copy(update={"kernel": "flash", "async_softmax": False})
        backend.dense = make_attention_backend(flash, device, vendor)  # type: ignore[arg-type]
    backend.decode = backend._decode
    backend.store_kv = backend._store
    backend.post_store = backend._quantize
    backend.prefill = backend._prefill
    logger.info("attention: %s", name)
    return backend
