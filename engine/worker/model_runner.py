"""Turns a scheduled batch into one forward pass: metadata, KV cache, model call, logits.

The KV cache is a K and a V tensor `[num_layers, pages, block_size, Hkv, D]` (the backend may keep
fewer K pages than V pages: `key_cache_pages`), sized from `kv_cache_ratio` of free device memory
after a profiling forward (on CPU: of the configured byte budget) in the backend's `cache_layout`.
Metadata is built once per step and shared by every layer, with the attention backend's plan for
the step (made once, run by every layer). Decode steps replay a captured CUDA graph when
`capture_decode_graphs` was called (engine/worker/cuda_graph.py); prefill and batches wider than
the largest graph run eagerly.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import cast

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.kv_cache_spec import KVCacheSpec
from engine.attention.layer import Attention, forward_context
from engine.attention.metadata import AttentionCounters, AttentionMetadata, OutputRows
from engine.model.native_decode import NativeDecodeStep
from engine.request.sequence import Sequence
from engine.worker.cuda_graph import DecodeGraphs
from kernels.host_copy import host_to_device, to_device

logger = logging.getLogger(__name__)


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states to sample from
    sampled_seqs: list[Sequence]  # the sequences those rows belong to
    # (sequence, first prompt position predicted, rows lo, hi): prefill rows whose logits score the
    # next prompt token (`Sequence.needs_prompt_logprobs`)
    prompt_rows: list[tuple[Sequence, int, int, int]]
    # A step with prefill rows and no prompt logprobs reads only its sampled rows' final hidden states:
    # the model runs its last layer over those rows alone (None: every row goes through).
    output_rows: OutputRows | None = None


@dataclass
class PromptHidden:
    """Final hidden states [n, hidden] of one sequence's prefill positions whose logits score prompt
    tokens first .. first + n - 1 (the engine turns them into logits a slice at a time)."""

    seq: Sequence
    first: int
    hidden: torch.Tensor
    # On a tensor-parallel driver: (the execute's serial, index in its list), where every rank keeps the same rows.
    origin: tuple[int, int] | None = None


@dataclass
class ExecuteResult:
    """What one `ModelRunner.execute` forward produced."""

    logits: torch.Tensor               # float32 [len(sampled_seqs), V]
    sampled_seqs: list[Sequence]       # the sequences whose prompt is complete: row i is sampled_seqs[i]'s
    counters: AttentionCounters        # attention counters of the step
    prompt_hidden: list[PromptHidden]  # for prompt logprobs (`Sequence.needs_prompt_logprobs`)


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, dtype: torch.dtype, block_size: int,
                 backend: AttentionBackend, kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.backend = backend
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        first = self.attention_layers[0]
        self.spec = KVCacheSpec(num_layers=len(self.attention_layers), num_heads=first.num_heads,
                                num_kv_heads=first.num_kv_heads, head_dim=first.head_dim, block_size=block_size,
                                dtype=dtype, cache_dtype=kv_dtype)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.num_blocks = 0
        self.graphs: DecodeGraphs | None = None
        self.native_decode: NativeDecodeStep | None = None   # a CPU decode step in one C++ call (worker.py sets it)
        self.num_graph_steps = 0   # decode steps served by a graph replay (the rest ran eagerly)
        # A prefill step's last layer over its sampled rows alone (`OutputRows`); off where every row's
        # attention in every layer is wanted (`fdserve calibrate` records them).
        self.last_layer_sampled_rows_only = True

    def num_blocks_for_budget(self, budget_bytes: int) -> int:
        per_block, fixed = self.backend.cache_layout(self.spec, budget_bytes)
        return max(0, (budget_bytes - fixed) // per_block)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        s = self.spec
        self.native_decode = None   # it holds the pages' addresses
        key_pages = self.backend.key_cache_pages(num_blocks)
        shape = (s.block_size, s.num_kv_heads, s.head_dim)
        self.k_cache = torch.zeros(s.num_layers, key_pages, *shape, dtype=s.kv_dtype, device=self.device)
        self.v_cache = torch.zeros(s.num_layers, num_blocks, *shape, dtype=s.kv_dtype, device=self.device)
        for i, layer in enumerate(self.attention_layers):
            if layer.layer_idx != i:   # backends index their per-layer state by layer_idx
                raise ValueError(f"attention layer {i} of the model says it is layer {layer.layer_idx}")
            layer.k_cache = self.k_cache[i]
            layer.v_cache = self.v_cache[i]
        self.num_blocks = num_blocks
        self.backend.allocate(s, self.k_cache, self.v_cache)

    @torch.inference_mode()
    def profile_peak_bytes(self, num_tokens: int) -> int:
        """Peak activation bytes of one dummy prefill of `num_tokens` (0 on CPU).

        Measured above what is allocated before the forward (weights, the small profiling cache),
        so only what a full step adds on top is counted."""
        self.allocate_kv_cache(max(1, -(-num_tokens // self.block_size)))
        seq = Sequence("profile", [0] * num_tokens, _dummy_params())
        seq.block_table = list(range(self.num_blocks))
        seq.num_scheduled_tokens = num_tokens
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        self.execute([seq])
        peak = torch.cuda.max_memory_allocated(self.device) - base if on_gpu else 0
        self.k_cache = self.v_cache = None
        for layer in self.attention_layers:
            layer.k_cache = layer.v_cache = None
        if on_gpu:
            torch.cuda.empty_cache()  # so that mem_get_info sees the profiling memory as free again
        return peak

    def capture_decode_graphs(self, max_batch: int, max_context_len: int) -> None:
        """Capture decode steps of up to `max_batch` sequences of up to `max_context_len` tokens."""
        if self.v_cache is None:
            raise RuntimeError("allocate the KV cache before capturing CUDA graphs")
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; this runs on {self.device}")
        max_blocks = -(-max_context_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.backend, self.device, max_batch, max_blocks)
        self.graphs.capture()

    def prepare(self, seqs: list[Sequence]) -> StepInputs:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Sequence] = []
        sampled_at: list[int] = []   # their places in `seqs`
        prompt_rows: list[tuple[Sequence, int, int, int]] = []
        bs = self.block_size
        for seq in seqs:
            start = seq.num_computed_tokens
            end = start + seq.num_scheduled_tokens
            if seq.needs_prompt_logprobs:
                scored = min(end, seq.num_prompt_tokens - 1) - start   # positions whose next token is prompt
                if scored > 0:
                    prompt_rows.append((seq, start + 1, len(input_ids), len(input_ids) + scored))
            host_ids = seq.token_ids[start:end]
            input_ids.extend(host_ids + [0] * (end - start - len(host_ids)))   # in flight: `execute` has them
            positions.extend(range(start, end))
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            if end == len(seq):  # the prompt is complete: this step yields a new token
                logits_indices.append(len(input_ids) - 1)
                sampled.append(seq)
                sampled_at.append(len(seq_lens) - 1)
        max_blocks = max(len(seq.block_table) for seq in seqs)
        # One tensor from padded lists: a per-row tensor and copy costs more than the row itself.
        block_tables = torch.tensor([seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs],
                                    dtype=torch.int32)
        dev = self.device
        # A step that samples waits for the device when its tokens are read; one that does not (the earlier
        # chunks of a long prompt) uploads without a stream sync, so the host builds the next chunk while
        # this one runs (bench/RESULTS.md).
        asynchronous = not sampled
        query_lens = [b - a for a, b in pairwise(query_start_loc)]
        metadata = AttentionMetadata(
            positions=to_device(positions, torch.long, dev, asynchronous),
            slot_mapping=to_device(slot_mapping, torch.long, dev, asynchronous),
            query_start_loc=to_device(query_start_loc, torch.int32, dev, asynchronous),
            seq_lens=to_device(seq_lens, torch.int32, dev, asynchronous),
            block_tables=host_to_device(block_tables, dev, asynchronous),
            max_query_len=max(query_lens),
            is_decode_only=all(n == 1 for n in query_lens),
            seq_lens_host=tuple(seq_lens),
            query_start_loc_host=tuple(query_start_loc),
            block_tables_host=block_tables,
        )
        rows = to_device(logits_indices, torch.long, dev, asynchronous)
        output_rows = None
        if self.last_layer_sampled_rows_only and not (metadata.is_decode_only or prompt_rows):
            output_rows = OutputRows(rows, self._rows_metadata(
                sampled_at, [positions[i] for i in logits_indices], [slot_mapping[i] for i in logits_indices],
                seq_lens, block_tables, metadata.counters) if sampled_at else None)
        return StepInputs(to_device(input_ids, torch.long, dev, asynchronous), metadata, rows, sampled, prompt_rows,
                          output_rows)

    def _rows_metadata(self, seq_at: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
                       block_tables: torch.Tensor, counters: AttentionCounters) -> AttentionMetadata:
        """One query row for each sequence at `seq_at`, its last, over everything before it (already stored);
        what its attention counts goes to the step's `counters`."""
        dev = self.device
        lens = [seq_lens[i] for i in seq_at]
        starts = list(range(len(seq_at) + 1))
        tables = block_tables[seq_at]
        return AttentionMetadata(
            positions=to_device(positions, torch.long, dev), slot_mapping=to_device(slots, torch.long, dev),
            query_start_loc=to_device(starts, torch.int32, dev), seq_lens=to_device(lens, torch.int32, dev),
            block_tables=host_to_device(tables, dev), max_query_len=1, is_decode_only=False, counters=counters,
            seq_lens_host=tuple(lens), query_start_loc_host=tuple(starts), block_tables_host=tables)

    @torch.inference_mode()
    def execute(self, seqs: list[Sequence], input_ids: torch.Tensor | None = None) -> ExecuteResult:
        """Forward the scheduled tokens; float32 logits for the sequences that sample this step.

        `input_ids` (device, one per sequence, decode steps only) replaces the token ids read from
        the sequences: the tokens the previous step sampled, not yet copied to the host (a
        sequence's `num_in_flight_tokens`).
        """
        decode = all(seq.num_scheduled_tokens == 1 for seq in seqs)
        if input_ids is not None and (not decode or input_ids.shape != (len(seqs),)):
            raise ValueError("input_ids replaces one token per sequence of a decode step")
        if input_ids is None and any(seq.num_in_flight_tokens for seq in seqs):
            raise ValueError("a token still in flight is not on the host: pass the step's input_ids")
        self.backend.prepare_pages(seqs)   # replayed graphs too: host bookkeeping such as FFD's pool pages
        if self.graphs is not None and decode and not any(   # a row that scores a prompt token runs eagerly
                seq.needs_prompt_logprobs and seq.num_computed_tokens + 1 < seq.num_prompt_tokens for seq in seqs):
            replayed = self._replay(seqs, input_ids)
            if replayed is not None:
                return replayed
        step = self.prepare(seqs)
        step.metadata.plan = self.backend.plan(step.metadata.step_shape)   # once for every layer of the step
        rows_metadata = step.output_rows.metadata if step.output_rows is not None else None
        if rows_metadata is not None:
            rows_metadata.plan = self.backend.plan(rows_metadata.step_shape)
        if input_ids is not None:
            step.input_ids = input_ids.to(self.device)
        native = self.native_decode
        with forward_context(step.metadata, self.backend):
            if native is not None and decode and native.takes(len(seqs)) and not step.prompt_rows:
                hidden = native.forward(step.input_ids, step.metadata)
            else:
                hidden = self.model(step.input_ids, step.metadata.positions, step.output_rows)
            # `hidden` holds the sampled rows alone where the model ran its last layer over them (output_rows)
            sampled_hidden = hidden if step.output_rows is not None else hidden[step.logits_indices]
            # inside the step, so that a decode step's rows take the LM head's decode weight
            logits = self._compute_logits(sampled_hidden) if step.sampled_seqs else None
        prompt_hidden = [PromptHidden(seq, first, hidden[lo:hi]) for seq, first, lo, hi in step.prompt_rows]
        if logits is None:
            return ExecuteResult(torch.empty(0), [], step.metadata.counters, prompt_hidden)
        return ExecuteResult(logits.float(), step.sampled_seqs, step.metadata.counters, prompt_hidden)

    def prompt_logits(self, part: PromptHidden, lo: int, hi: int) -> torch.Tensor:
        """float32 logits [hi - lo, V] of prompt rows lo..hi of `part` (prompt logprobs)."""
        return self._compute_logits(part.hidden[lo:hi]).float()

    def release_pages(self, pages: list[int]) -> None:
        """The block manager freed these pages (the backend's page state follows)."""
        self.backend.release(pages)

    def begin_step(self) -> None:
        """An engine step begins (a tensor-parallel driver tells its ranks; one process has nothing to do)."""

    def check_health(self) -> None:
        """Nothing to check in one process (a tensor-parallel driver checks its ranks)."""

    def close(self) -> None:
        """Nothing to stop in one process."""

    def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # every model class has compute_logits; nn.Module does not declare it
        return cast(Callable[[torch.Tensor], torch.Tensor], self.model.compute_logits)(hidden)

    def _replay(self, seqs: list[Sequence], input_ids: torch.Tensor | None) -> ExecuteResult | None:
        """The step through a captured graph, or None when no graph fits it (it then runs eagerly)."""
        assert self.graphs is not None
        width = max(len(seq.block_table) for seq in seqs)
        key = self.graphs.bucket_for(len(seqs), width)
        if key is None:
            return None
        self.graphs.stage(seqs, self.block_size)
        logits, counters = self.graphs.run(len(seqs), width, key, input_ids)
        self.num_graph_steps += 1
        # A one-token prefill chunk that does not end its prompt forwards but does not sample.
        rows = [i for i, seq in enumerate(seqs) if seq.num_computed_tokens + 1 == len(seq)]
        if len(rows) < len(seqs):
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
        return ExecuteResult(logits, [seqs[i] for i in rows], counters, [])


def _dummy_params():
    from engine.request.sampling_params import SamplingParams
    return SamplingParams(max_tokens=1)
