"""CUDA graphs for decode steps: one captured forward (with the LM head) per bucketed batch size
and block-table width.

A decode step of a Llama-8B-sized model launches a few hundred small kernels; eagerly, the host
needs longer to issue them than the GPU needs to run them at batch 1. A graph replays the whole
step with one launch.

Each graph reads static device buffers (token ids, positions, slot mapping, seq_lens, block
tables) and writes static logits. A step of B sequences replays the smallest bucket ≥ B: rows
past B are padding with slot -1 (their K/V is not stored), context length 1 and page 0, so
they read one valid cache row and their output is dropped. Graphs are captured largest first
into one shared memory pool, so the activations of all buckets share one allocation.

What the kernels decide on the host is frozen at capture: the split count depends only on
the batch size (`kernels.attention.decode_host.choose_num_splits`), the matmul config only on M, and
the block-table width is the widest a sequence can need, or, where the backend's choice depends
on it (`AttentionBackend.decode_graph_widths`: FFD's "auto" runs the Flash-Decoding kernel when
no row can reach its crossover), the narrowest captured width that holds the step's tables.
A graph freezes the attention plan it was captured with (`AttentionBackend.plan`: split counts, grids,
workspaces); the plan is made inside the capture, so its workspaces live in the graphs' shared memory pool
(graphs never replay at once). A replay runs only the backend's host bookkeeping (`prepare_pages`).
Counters the attention backend adds during capture are device tensors the graph updates
(returned as captured) or host floats proportional to the rows (scaled to the real batch).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.layer import forward_context
from engine.attention.metadata import AttentionCounters, AttentionMetadata, AttentionPlan, StepShape
from engine.request.sequence import Sequence

logger = logging.getLogger(__name__)

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to `max_batch` (which is always included)."""
    sizes = [b for b in SMALL_BUCKETS if b < max_batch]
    sizes += list(range(BUCKET_STEP, max_batch, BUCKET_STEP))
    return sorted(set(sizes) | {max_batch})


GraphKey = tuple[int, int]   # (batch size, block-table width in pages)


class DecodeGraphs:
    """Captured decode steps for batch sizes 1..max_batch and contexts up to max_blocks pages."""

    def __init__(self, model: nn.Module, backend: AttentionBackend, device: torch.device,
                 max_batch: int, max_blocks: int) -> None:
        self.model = model
        self.backend = backend
        self.device = device
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.batch_sizes = graph_batch_sizes(max_batch)
        self.widths = backend.decode_graph_widths(max_blocks) if backend is not None else [max_blocks]
        if self.widths != sorted(set(self.widths)) or self.widths[-1] != max_blocks or self.widths[0] < 1:
            raise ValueError(f"decode graph widths must ascend to {max_blocks} pages; the backend gave {self.widths}")
        dev = device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((max_batch,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.logits: torch.Tensor | None = None
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.counters: dict[GraphKey, AttentionCounters] = {}
        # Two sets of pinned host staging, used in turn: with asynchronous scheduling step N+1 is
        # staged before step N's reads are known to be done, but never before step N-1's are.
        self.staging = [_Staging(max_batch, max_blocks, pin=device.type == "cuda") for _ in range(2)]
        self.current = 0

    # ----- capture ---------------------------------------------------------------------------
    def _metadata(self, batch: int, width: int, counters: AttentionCounters) -> AttentionMetadata:
        return AttentionMetadata(
            positions=self.positions[:batch], slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[:batch + 1], seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch, :width], max_query_len=1, is_decode_only=True,
            counters=counters)

    def _plan(self, batch: int, width: int) -> AttentionPlan:
        return self.backend.plan(StepShape(num_seqs=batch, table_width=width, decode_only=True))

    def _forward(self, batch: int, width: int, plan: AttentionPlan, counters: AttentionCounters) -> torch.Tensor:
        metadata = self._metadata(batch, width, counters)
        metadata.plan = plan
        with forward_context(metadata, self.backend):
            hidden = self.model(self.input_ids[:batch], self.positions[:batch])
        # every model class has compute_logits; nn.Module does not declare it
        return cast(Callable[[torch.Tensor], torch.Tensor], self.model.compute_logits)(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles every kernel config) and capture each bucket, largest first."""
        start = time.perf_counter()
        vocab = self._forward(1, self.max_blocks, self._plan(1, self.max_blocks), {}).shape[-1]
        self.logits = torch.empty(self.max_batch, vocab, dtype=torch.float32, device=self.device)
        pool = None
        for width in reversed(self.widths):
            for batch in reversed(self.batch_sizes):
                self._forward(batch, width, self._plan(batch, width), {})   # eager warm-up: Triton compiles
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                counters: AttentionCounters = {}
                with torch.cuda.graph(graph, pool=pool):
                    plan = self._plan(batch, width)   # same shapes as the warm-up: the same splits and grids
                    self.logits[:batch].copy_(self._forward(batch, width, plan, counters))
                pool = graph.pool() if pool is None else pool
                self.graphs[batch, width] = graph
                self.counters[batch, width] = counters
        torch.cuda.synchronize(self.device)
        logger.info("CUDA graphs captured for decode batch sizes %s and block-table widths %s pages in %.1f s",
                    ",".join(map(str, self.batch_sizes)), ",".join(map(str, self.widths)),
                    time.perf_counter() - start)

    # ----- replay ----------------------------------------------------------------------------
    def bucket_for(self, batch: int, num_blocks: int) -> GraphKey | None:
        """The captured (batch size, table width) that serves `batch` sequences needing `num_blocks`
        pages, if any: the smallest of each that holds them."""
        if batch > self.max_batch or num_blocks > self.max_blocks or not self.graphs:
            return None
        return (next(b for b in self.batch_sizes if b >= batch), next(w for w in self.widths if w >= num_blocks))

    def stage(self, seqs: list[Sequence], block_size: int) -> None:
        """Write the step's inputs (one new token per sequence) into the next pinned staging set."""
        self.current ^= 1
        self.staging[self.current].write(seqs, block_size)

    def run(self, batch: int, width: int, key: GraphKey, input_ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, AttentionCounters]:
        """Replay the graph of `key` (`bucket_for`) on the staged inputs of `batch` sequences whose
        block tables are at most `width` pages (token ids from the device tensor `input_ids` when
        given); (float32 logits [batch, V], attention counters)."""
        bucket = key[0]
        st = self.staging[self.current]
        st.pad(batch, bucket)
        self.input_ids[:bucket].copy_(st.tokens[0, :bucket], non_blocking=True)
        if input_ids is not None:   # stream-ordered after the staging copy it overrides
            self.input_ids[:batch].copy_(input_ids)
        self.positions[:bucket].copy_(st.tokens[1, :bucket], non_blocking=True)
        self.slot_mapping[:bucket].copy_(st.tokens[2, :bucket], non_blocking=True)
        self.seq_lens[:bucket].copy_(st.seq_lens[:bucket], non_blocking=True)
        # Only the columns in use: the kernels read no page past a row's seq_lens.
        self.block_tables[:batch, :width].copy_(st.block_tables[:batch, :width], non_blocking=True)
        if bucket > batch:
            self.block_tables[batch:bucket, 0] = 0
        self.graphs[key].replay()
        assert self.logits is not None
        return self.logits[:batch], scaled_counters(self.counters[key], batch / bucket)


class _Staging:
    """One set of pinned host buffers for a step's graph inputs."""

    def __init__(self, max_batch: int, max_blocks: int, pin: bool) -> None:
        self.tokens = torch.zeros(3, max_batch, dtype=torch.long, pin_memory=pin)   # ids, positions, slots
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, pin_memory=pin)
        self.block_tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, pin_memory=pin)
        self.np_tokens, self.np_seq_lens = self.tokens.numpy(), self.seq_lens.numpy()
        self.np_block_tables = self.block_tables.numpy()
        # Whose table each row holds, and how many of its pages: a decode step usually adds no
        # page, so rows are only appended to (a full rebuild is B × pages Python ints per step).
        self.row_owner: list[tuple[int, int] | None] = [None] * max_batch
        self.row_pages = [0] * max_batch

    def write(self, seqs: list[Sequence], block_size: int) -> None:
        host, tables = self.np_tokens, self.np_block_tables
        for i, seq in enumerate(seqs):
            pos = seq.num_computed_tokens
            table = seq.block_table
            host[0, i] = seq.token_ids[pos] if pos < len(seq.token_ids) else 0   # in flight: `run` copies it
            host[1, i] = pos
            host[2, i] = table[pos // block_size] * block_size + pos % block_size
            owner = (seq.seq_id, seq.num_preemptions)   # a preempted sequence gets new pages
            have = self.row_pages[i] if self.row_owner[i] == owner else 0
            if have < len(table):
                tables[i, have:len(table)] = table[have:]
            self.row_owner[i], self.row_pages[i] = owner, len(table)
        self.np_seq_lens[:len(seqs)] = host[1, :len(seqs)] + 1

    def pad(self, batch: int, bucket: int) -> None:
        """Rows batch..bucket embed token 0 at position 0, store nothing, read one row of page 0."""
        self.np_tokens[:2, batch:bucket] = 0
        self.np_tokens[2, batch:bucket] = -1
        self.np_seq_lens[batch:bucket] = 1


def scaled_counters(counters: AttentionCounters, fraction: float) -> AttentionCounters:
    """Captured counters for a step of `fraction` of the bucket's rows: device tensors as the
    graph left them (padding rows add nothing to them), host floats scaled to the real rows."""
    return {k: (v * fraction if isinstance(v, float) else v) for k, v in counters.items()}
