"""`[flashdecoding] kernel = "ffd" | "auto"`: the Faster Flash Decoding attention backend.

NVIDIA GPUs of compute capability 8.9 or later (FP8 E4M3 residuals) or the CPU; on AMD the
engine refuses it at startup and names kernel = "flash".

Every attention call of every layer applies the per-query rule of `kernels/ffd/reference.py`
(2-bit scan, top-δ block selection against a pseudo-max from the sinks and the local window,
refined keys for kept blocks, exact tail), in decode and in prefill alike, so that chunked
prefill, prefix-cache hits, multi-turn and preemption/recompute all give what a cold run gives.

  where   decode                   prefill                          store K/V + quantize pages
  GPU     Triton (kernels/ffd/decode.py)  Triton (kernels/ffd/prefill.py)  Triton (store_kv + quantize)
  CPU     torch rule               torch rule                       torch

With every exact K page kept ("auto") the GPU's K/V write is RoPE's fused one (`post_store`
quantizes after it: fewer launches per layer). The compact pool keeps the backend's own store: the
fused write through its page map gained nothing (bench/RESULTS.md).

"auto": queries whose context is shorter than a crossover length attend densely over the exact
keys (inside the same kernel: split-KV with log-sum-exp merge, i.e. Flash-Decoding), longer ones
use FFD. A step whose block table is too narrow for any row to reach the crossover runs the
Flash-Decoding backend itself (`dense`), decode and prefill: the FFD kernel's dense decode rows
cost its three launches, more than the Flash-Decoding kernel's (bench/RESULTS.md).
Decode graphs are captured at that width too (`decode_graph_widths`), so short contexts replay
the Flash-Decoding graph. The crossover is per GPU, measured by `bench/ffd_kernels.py --crossover`
and stored in `kernels/ffd/crossover.json`; `[flashdecoding] ffd_crossover_tokens` overrides it (a
GPU's own measurement), and a device with neither is a startup error (never a guess). Where the measurement
found FFD never faster, "auto" builds the plain Flash-Decoding backend and says so at startup.

Per step, `plan` makes one FFD decode plan (`kernels.plan_ffd_decode`: grids, split counts,
workspaces) for a decode-only step on the Triton path, or the Flash-Decoding backend's plan for a
step that runs on it; each layer's `decode` runs it (`kernels.run_ffd_decode`).

Sparsity counters (decode steps): `ffd_blocks_total` and `ffd_blocks_kept`, counted over
(KV head, full block) pairs and summed over the layers, go into the step's `counters` (exported by
/metrics); on the GPU they are the plan's device counters (`FFDPlan.stats`, zeroed at layer 0 of
each step, inside a captured graph too), read without a sync.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.dense import DenseBackend
from engine.attention.ffd_cache import ExactKeyPages, FFDCacheSpec, FFDKeyCache, exact_pool_pages
from engine.attention.kv_cache_spec import KVCacheSpec
from engine.attention.metadata import AttentionPlan, StepShape
from engine.config import FlashDecodingConfig
from kernels import store_kv
from kernels.attention import reference
from kernels.ffd.crossover import crossover_table
from kernels.ffd.decode import (
    FFDDecodePlan,
    check_ffd_inputs,
    ffd_sync_buffer,
    plan_ffd_decode,
    run_ffd_decode,
    sync_entries,
)
from kernels.ffd.prefill import ffd_prefill
from kernels.ffd.quantize import quantize_on_write
from kernels.ffd.reference import (
    FFDParams,
    QuantizedPages,
    ffd_decode_ref,
    ffd_prefill_ref,
    quantize_on_write_ref,
)

if TYPE_CHECKING:
    from engine.attention.metadata import AttentionMetadata
    from engine.request.sequence import Sequence

logger = logging.getLogger(__name__)

NEVER = 2**31 - 1   # a crossover no context reaches: FFD never runs
COMPACT_TEXT = "exact keys only for pages being filled"
FULL_TEXT = "exact K kept for every page: saves read bandwidth, not memory"


@dataclass(frozen=True)
class FFDPlan(AttentionPlan):
    """A decode-only step's FFD kernel plan on the Triton path, shared by every layer of the step, and
    its counters: stats int64 [2] = (full blocks, kept blocks) summed over the step's layers."""

    decode: FFDDecodePlan
    stats: torch.Tensor


def params_from_config(fd: FlashDecodingConfig, min_ffd_len: int = 0) -> FFDParams:
    return FFDParams(block_size=int(fd.ffd_block_size),
                     delta_log2=FFDParams.delta_to_log2(float(fd.delta), fd.delta_units),
                     sink_tokens=int(fd.sink_tokens), local_window=int(fd.local_window),
                     min_ffd_len=min_ffd_len)


def crossover_for(device: torch.device, configured: int | None = None) -> int:
    """`[flashdecoding] ffd_crossover_tokens` where set, else the length stored for this GPU
    (NEVER where it was measured and FFD was never faster)."""
    if configured is not None:
        return configured
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    table = crossover_table()
    if name not in table:
        known = ", ".join(f"{k}: {v}" for k, v in table.items()) or "none"
        raise ValueError(f"[flashdecoding] kernel = \"auto\" needs a measured FFD crossover context length "
                         f"for {name!r} (stored: {known}): run `python bench/ffd_kernels.py --crossover` "
                         f"on this GPU and set [flashdecoding] ffd_crossover_tokens to the length it prints, "
                         f"or set kernel = \"ffd\" or \"flash\"")
    measured = table[name]
    return NEVER if measured is None else measured


def check_ffd_device(device: torch.device, vendor: str, kernel: str) -> None:
    """The FFD kernels run on NVIDIA GPUs with FP8 E4M3 (compute capability >= 8.9) or on the CPU.

    A ROCm build of torch reports its GPU as device type "cuda", so AMD is told apart by the vendor
    and by `torch.version.hip`, before any CUDA query."""
    if device.type != "cuda":
        return
    if vendor != "nvidia" or getattr(torch.version, "hip", None):
        raise ValueError(f"[flashdecoding] kernel = \"{kernel}\" has Triton kernels for NVIDIA GPUs only (FP8 E4M3 "
                         f"residuals); gpu_vendor is {vendor!r}: set kernel = \"flash\" (Flash-Decoding) on this GPU")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"[flashdecoding] kernel = \"{kernel}\" needs FP8 E4M3 (compute capability >= 8.9); "
                         f"this GPU is {major}.{minor}: set kernel = \"flash\"")


class FFDBackend(AttentionBackend):
    """kernel = "ffd" (`dense` None, compact K cache) or "auto" (`dense`: the Flash-Decoding backend
    for steps with every row below `min_ffd_len`, every exact K page kept)."""

    def __init__(self, fd: FlashDecodingConfig, device: torch.device, *, min_ffd_len: int = 0,
                 max_num_seqs: int, max_num_batched_tokens: int, dense: DenseBackend | None = None) -> None:
        if fd.kernel not in ("ffd", "auto"):
            raise ValueError(f"FFDBackend serves kernel = 'ffd' | 'auto', got {fd.kernel!r}")
        self.variant = fd.kernel
        self.params = params_from_config(fd, min_ffd_len)
        self.device = device
        self.num_splits = fd.num_splits
        self.triton = device.type == "cuda"      # Triton store/decode (GPU; the interpreter in tests)
        self.dense = dense
        self.compact = fd.kernel == "ffd"        # exact K only for pages being filled (engine/attention/ffd_cache.py)
        self.pool_pages = exact_pool_pages(max_num_seqs, max_num_batched_tokens, self.params.block_size)
        self.cache: FFDKeyCache | None = None
        self.exact: ExactKeyPages | None = None
        self.sync: torch.Tensor | None = None    # the decode's counters, zero between calls (ffd_sync_buffer)
        self.spec: KVCacheSpec | None = None     # the cache the plans are made for (`allocate`)
        params = self.params
        if params.sink_tokens == 0 and params.local_window == 0:
            logger.warning("[flashdecoding] sink_tokens = local_window = 0: no pseudo-max, so FFD keeps every block")
        units = f"δ = {fd.delta:g} ({'natural log' if fd.delta_units == 'e' else 'log2'} units, "
        units += f"{params.delta_log2:.3f} in log2)"
        where = "triton decode and prefill" if self.triton else "torch reference (cpu)"
        mode = (f"auto: dense Flash-Decoding below {min_ffd_len} context tokens (steps with no row above: "
                f"the Flash-Decoding backend), FFD from there") if fd.kernel == "auto" else "FFD"
        memory = COMPACT_TEXT if self.compact else FULL_TEXT
        self.name = (f"{where}: Faster Flash Decoding [{mode}] (2-bit keys + FP8 residual in blocks of "
                     f"{params.block_size}, top-δ per GQA group, {units}, sinks {params.sink_tokens}, "
                     f"local window {params.local_window}; {memory})")

    # ----- cache (engine and model runner) ----------------------------------------------------
    def page_size(self, configured: int) -> int:
        """One quantization block, whatever `[backend] block_size` says."""
        return self.params.block_size

    def key_cache_pages(self, num_blocks: int) -> int:
        return min(num_blocks, self.pool_pages) if self.compact else num_blocks

    def cache_bytes(self, spec: KVCacheSpec, compact: bool | None = None) -> tuple[int, int]:
        """(bytes per KV page, fixed bytes): V pages and quantized keys, and exact K pages per page
        (full layout) or as a fixed pool (compact; default: the current layout)."""
        quantized = FFDCacheSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                 self.params.block_size).bytes_per_block
        half = spec.bytes_per_block // 2                        # the K (or the V) pages of one KV page
        if self.compact if compact is None else compact:
            return half + quantized, half * self.key_cache_pages(1 << 62)
        return 2 * half + quantized, 0

    def cache_layout(self, spec: KVCacheSpec, budget_bytes: int) -> tuple[int, int]:
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

    def allocate(self, spec: KVCacheSpec, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Allocate the quantized keys of the N KV pages and, compact, the page -> K page map."""
        self.spec = spec
        self.device = v_cache.device   # with its index: the plans' workspaces live beside the pages
        if self.dense is not None:
            self.dense.allocate(spec, k_cache, v_cache)
        num_layers, num_blocks, block_size, kv_heads, head_dim = v_cache.shape
        if block_size != self.params.block_size:
            raise ValueError(f"KV pages of {block_size} tokens; FFD needs pages of ffd_block_size = "
                             f"{self.params.block_size}")
        if k_cache.shape[1] != self.key_cache_pages(num_blocks):
            raise ValueError(f"FFD: {k_cache.shape[1]} K pages for {num_blocks} KV pages; "
                             f"expected {self.key_cache_pages(num_blocks)}")
        self.cache = FFDKeyCache(FFDCacheSpec(num_layers, kv_heads, head_dim, block_size), num_blocks, v_cache.device)
        self.exact = ExactKeyPages(num_blocks, k_cache.shape[1], v_cache.device) if self.compact else None
        # Every exact K page kept: the layer may write K/V with RoPE in one launch (kernels/fused.py),
        # then `post_store` quantizes. Not through the pool's page map: that gained nothing (bench/RESULTS.md).
        self.fuse_rope_store = self.triton and self.exact is None

    def release(self, pages: list[int]) -> None:
        if self.exact is not None:
            self.exact.release(pages)

    def decode_graph_widths(self, max_blocks: int) -> list[int]:
        """Graphs at `dense_width` too (the Flash-Decoding backend), where it is narrower than the widest."""
        return [self.dense_width, max_blocks] if 0 < self.dense_width < max_blocks else [max_blocks]

    # ----- per step ---------------------------------------------------------------------------
    def prepare_pages(self, seqs: list[Sequence]) -> None:
        """Pool pages for the pages this step writes (compact K cache only)."""
        if self.exact is None:
            return
        bs = self.params.block_size
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

    def plan(self, shape: StepShape) -> AttentionPlan:
        """"auto" steps on the Flash-Decoding backend: its plan; decode-only steps on the Triton path:
        one FFD decode plan and counter buffer for every layer; else nothing."""
        if self._dense_step(shape.table_width):
            assert self.dense is not None
            return self.dense.plan(shape)
        if not (self.triton and shape.decode_only):
            return AttentionPlan()
        if self.spec is None:
            raise RuntimeError("FFD: no KV cache spec to plan for (allocate was not called)")
        s = self.spec
        decode = plan_ffd_decode(shape.num_seqs, s.num_heads, s.num_kv_heads, s.head_dim, s.block_size,
                                 shape.table_width, dtype=s.dtype, device=self.device, params=self.params,
                                 kv_dtype=s.dtype, num_splits=self.num_splits or None,
                                 has_key_page_map=self.key_page_map is not None, count_stats=True,
                                 sync=self._decode_sync(shape.num_seqs, s.num_kv_heads))
        return FFDPlan(decode, torch.zeros(2, dtype=torch.int64, device=self.device))

    def pages_of(self, layer_idx: int) -> QuantizedPages:
        if self.cache is None:
            raise RuntimeError("FFD: no quantized keys (allocate was not called)")
        return self.cache.layer(layer_idx)

    @property
    def dense_width(self) -> int:
        """"auto": the widest block table (pages) none of whose rows reaches the crossover (a row of a
        table W pages wide has at most W * page_size tokens, and is dense below min_ffd_len); 0 else."""
        if self.dense is None:
            return 0
        return (self.params.min_ffd_len - 1) // self.params.block_size

    def _dense_step(self, table_width: int) -> bool:
        """"auto": no row of a step whose block table is `table_width` pages wide can reach the crossover,
        so it runs on the Flash-Decoding backend."""
        return self.dense is not None and table_width <= self.dense_width

    @property
    def key_page_map(self) -> torch.Tensor | None:
        """The page -> K page map the kernels take (None: the full layout, K page = page)."""
        return self.exact.key_page_map if self.exact is not None else None

    # ----- per layer --------------------------------------------------------------------------
    def store(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.triton:
            store_kv(key, value, k_cache, v_cache, slot_mapping, self.key_page_map)
        else:
            reference.store_kv_ref(key, value, k_cache, v_cache, slot_mapping, self.key_page_map)
        self.post_store(layer_idx, k_cache, slot_mapping)

    def post_store(self, layer_idx: int, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """After a K/V write (the backend's own, or RoPE's fused one): quantize the blocks it filled."""
        pages = self.pages_of(layer_idx)
        if self.triton:
            quantize_on_write(k_cache, pages.codes, pages.scales, pages.residual, slot_mapping, self.key_page_map)
        else:
            quantize_on_write_ref(k_cache, pages.codes, pages.scales, pages.residual, slot_mapping, self.key_page_map)

    def decode(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        if self._dense_step(metadata.block_tables.shape[1]):
            assert self.dense is not None
            return self.dense.decode(layer_idx, q, k_cache, v_cache, metadata, scale=scale)
        pages = self.pages_of(layer_idx)
        if not self.triton:
            counted: dict[str, float] = {}
            out = ffd_decode_ref(q, k_cache, v_cache, pages, metadata.block_tables, metadata.seq_lens, scale=scale,
                                 params=self.params, stats=counted, key_page_map=self.key_page_map)
            for key, value in counted.items():   # integral floats: exact in any order
                metadata.counters[key] = metadata.counters.get(key, 0.0) + value
            return out
        plan = metadata.plan
        if not isinstance(plan, FFDPlan):
            raise RuntimeError(f"FFDBackend.decode on the Triton path needs the step's FFDBackend.plan in its "
                               f"metadata; got {type(plan).__name__}")
        if layer_idx == 0:
            check_ffd_inputs("FFD decode", q, k_cache, v_cache, metadata.block_tables, metadata.seq_lens, self.params)
            plan.stats.zero_()
        out = run_ffd_decode(plan.decode, q, k_cache, v_cache, pages.codes, pages.scales, pages.residual,
                             metadata.block_tables, metadata.seq_lens, scale=scale, stats=plan.stats,
                             key_page_map=self.key_page_map)
        metadata.counters["ffd_blocks_total"] = plan.stats[0]
        metadata.counters["ffd_blocks_kept"] = plan.stats[1]
        return out

    def _decode_sync(self, batch: int, kv_heads: int) -> torch.Tensor:
        """One counter buffer for every plan's decode (they run in stream order), grown with the batch;
        every run leaves it zero, so no memset per run."""
        if self.sync is None or self.sync.numel() < sync_entries(batch, kv_heads):
            self.sync = ffd_sync_buffer(max(batch, 64), kv_heads, self.device)
        return self.sync

    def prefill(self, layer_idx: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, *, scale: float) -> torch.Tensor:
        if self._dense_step(metadata.block_tables.shape[1]):
            assert self.dense is not None
            return self.dense.prefill(layer_idx, q, k_cache, v_cache, metadata, scale=scale)
        pages = self.pages_of(layer_idx)
        if self.triton:
            return ffd_prefill(q, k_cache, v_cache, pages.codes, pages.scales, pages.residual, metadata.block_tables,
                               metadata.seq_lens, metadata.query_start_loc, scale=scale, params=self.params,
                               key_page_map=self.key_page_map)
        return ffd_prefill_ref(q, k_cache, v_cache, pages, metadata.block_tables, metadata.seq_lens,
                               metadata.query_start_loc, scale=scale, params=self.params,
                               key_page_map=self.key_page_map)
