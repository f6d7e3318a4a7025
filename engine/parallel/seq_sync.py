"""Keeps the other ranks' copies of the scheduled sequences in step with rank 0's, sending only what changed.

Both sides follow one rule: after a message, a rank holds exactly the sequences that message named. A
sequence that sat out a step (waiting, preempted, finished) is sent whole the next time it runs; one that
runs step after step (decoding) costs its new token and any new page. Token ids only grow, and a block table
only grows until the block manager frees it and gives the sequence a new list (preemption), which is
sent whole.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.parallel.messages import SeqUpdate
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence, SequenceStatus


@dataclass
class _Sent:
    num_tokens: int
    table: list[int]     # the very list object sent (a new one after preemption)
    table_len: int


class SeqEncoder:
    """Rank 0's side: what the other ranks hold, and the updates that bring them to `seqs`."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}

    def encode(self, seqs: list[Sequence]) -> list[SeqUpdate]:
        updates: list[SeqUpdate] = []
        sent: dict[int, _Sent] = {}
        for seq in seqs:
            before = self._sent.get(seq.seq_id)
            new = before is None
            tokens = seq.token_ids if before is None else seq.token_ids[before.num_tokens:]
            table = seq.block_table
            new_table = before is None or before.table is not table or before.table_len > len(table)
            block_ids = list(table) if new_table or before is None else table[before.table_len:]
            updates.append(SeqUpdate(
                seq_id=seq.seq_id, num_preemptions=seq.num_preemptions, num_prompt_tokens=seq.num_prompt_tokens,
                new=new, token_ids=list(tokens), new_table=new_table, block_ids=block_ids,
                num_computed_tokens=seq.num_computed_tokens, num_scheduled_tokens=seq.num_scheduled_tokens,
                num_in_flight_tokens=seq.num_in_flight_tokens, num_prompt_logprobs=len(seq.prompt_logprobs)))
            sent[seq.seq_id] = _Sent(len(seq.token_ids), table, len(table))
        self._sent = sent
        return updates

    def forget(self) -> None:
        """The ranks hold nothing (a message was lost with a failure): send everything next time."""
        self._sent = {}


class SeqMirror:
    """The other ranks' side: their copies, updated from rank 0's updates."""

    _PARAMS = SamplingParams(max_tokens=1)   # a copy runs forwards only; it is never sampled

    def __init__(self) -> None:
        self._seqs: dict[int, Sequence] = {}

    def apply(self, updates: list[SeqUpdate]) -> list[Sequence]:
        seqs: dict[int, Sequence] = {}
        for u in updates:
            seq = None if u.new else self._seqs.get(u.seq_id)
            if seq is None:
                if not u.new:
                    raise RuntimeError(f"rank 0 updated sequence {u.seq_id}, which this rank does not hold")
                seq = Sequence(f"mirror-{u.seq_id}", u.token_ids[:u.num_prompt_tokens], self._PARAMS)
                seq.seq_id = u.seq_id
                seq.token_ids = list(u.token_ids)
                seq.status = SequenceStatus.RUNNING
            else:
                seq.token_ids.extend(u.token_ids)
            if u.new_table:
                seq.block_table = list(u.block_ids)
            else:
                seq.block_table.extend(u.block_ids)
            seq.num_preemptions = u.num_preemptions
            seq.num_computed_tokens = u.num_computed_tokens
            seq.num_scheduled_tokens = u.num_scheduled_tokens
            seq.num_in_flight_tokens = u.num_in_flight_tokens
            if len(seq.prompt_logprobs) != u.num_prompt_logprobs:   # only its length is read (needs_prompt_logprobs)
                seq.prompt_logprobs = [None] * u.num_prompt_logprobs
            seqs[u.seq_id] = seq
        self._seqs = seqs
        return [seqs[u.seq_id] for u in updates]
