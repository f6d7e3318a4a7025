"""The per-step data every attention layer reads: the batch's metadata, the shape a backend
plans for, and the plan it made."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

# What a backend counts in a step: host floats, or 0-d device tensors the kernels add to (read without a sync).
AttentionCounters = dict[str, float | torch.Tensor]


@dataclass(frozen=True)
class StepShape:
    """What a step's kernel plans depend on: its rows, its block-table width (pages) and whether
    every row decodes one token (`AttentionMetadata.step_shape`)."""

    num_seqs: int
    table_width: int
    decode_only: bool


@dataclass(frozen=True)
class AttentionPlan:
    """What a backend decided on the host for one step, read by its kernels through the step's
    metadata (`AttentionMetadata.plan`); this base is empty, for steps where a backend plans nothing."""


@dataclass
class AttentionMetadata:
    """What one forward step needs to know about its batch (vLLM vocabulary).

    positions[T]        position of each new token in its sequence
    slot_mapping[T]     cache slot (block * block_size + row) each new token's K/V goes to; -1 skips
    query_start_loc[B+1] offsets of each sequence's new tokens in the flat token batch
    seq_lens[B]         context length of each sequence after this step (cached + new tokens)
    block_tables[B, M]  the pages of each sequence, padded with 0
    plan                the backend's host-side decisions for this step (`AttentionBackend.plan` of `step_shape`)
    counters            what the backend counted this step (summed by the engine, exported by /metrics)
    seq_lens_host, query_start_loc_host, block_tables_host: host copies, where the runner has them
                        (empty / None otherwise)
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    is_decode_only: bool
    counters: AttentionCounters = field(default_factory=dict)
    plan: AttentionPlan = field(default_factory=AttentionPlan)
    seq_lens_host: tuple[int, ...] = ()
    query_start_loc_host: tuple[int, ...] = ()
    block_tables_host: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def step_shape(self) -> StepShape:
        """What the backend's plan for this step depends on."""
        return StepShape(self.num_seqs, int(self.block_tables.shape[1]), self.is_decode_only)


@dataclass
class OutputRows:
    """The rows of a step whose final hidden states are read (the rows that sample), for a model that runs
    its last layer over them alone: every row still stores its K/V there, but no other row's attention,
    MLP or final norm is read by anything.

    index[N]   the rows in the flat batch, in order
    metadata   their attention: a prefill of one query each over everything before it (their sequences'
               `seq_lens` and `block_tables`); None when N = 0, where the last layer only stores K/V
    """

    index: torch.Tensor
    metadata: AttentionMetadata | None

    @property
    def empty(self) -> bool:
        return self.metadata is None
