"""The scheduler owns every scheduling decision: which sequences run in a step, how many tokens
each, their KV slots, admission and preemption.

Continuous batching: one token budget per step, decodes first, then prefill chunks. Running
sequences (decoding, or mid-way through a chunked prefill) are served first, oldest first;
waiting sequences are admitted while the budget, `max_num_seqs` and free blocks allow. When
blocks run out, the newest running sequence is preempted by recompute: its blocks are freed and
it goes back to the front of the queue with all its tokens, to be prefilled again. Nothing is
dropped. With asynchronous scheduling, `schedule_decode_continuation` schedules the decode step
that follows one still in flight.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.core.block_manager import BlockManager
from engine.request.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    scheduled: list[Sequence]  # each with `num_scheduled_tokens` set
    num_batched_tokens: int
    preempted: list[Sequence]


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def can_admit(self) -> bool:
        """A waiting sequence could join the running batch now (so the next step should be scheduled
        by `schedule`, not continued ahead)."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        preempted: list[Sequence] = []

        for seq in list(self.running):  # oldest first
            if seq not in self.running or budget == 0:
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            while not self.block_manager.can_allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            self.block_manager.allocate_slots(seq, num_new)
            seq.num_scheduled_tokens = num_new
            scheduled.append(seq)
            budget -= num_new

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.allocate_cached_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(seq, num_new):
                self.block_manager.free(seq)  # give back prefix hits; looked up again next step
                break
            self.waiting.popleft()
            self.block_manager.allocate_slots(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            seq.num_scheduled_tokens = num_new
            self.running.append(seq)
            scheduled.append(seq)
            budget -= num_new

        return SchedulerOutput(scheduled, self.max_num_batched_tokens - budget, preempted)

    def schedule_decode_continuation(self, seqs: list[Sequence]) -> list[Sequence] | None:
        """Schedule one more decode token for each of `seqs` (running sequences whose previous token
        is still in flight): `seqs`, each with a KV slot allocated and `num_scheduled_tokens` = 1;
        or None, allocating nothing, when there are none, a waiting sequence could be admitted
        instead, or the free blocks do not cover them all (no preemption: `schedule` decides that)."""
        bm = self.block_manager
        if not seqs or self.can_admit() or sum(bm.blocks_needed(seq, 1) for seq in seqs) > bm.num_free_blocks:
            return None
        for seq in seqs:
            bm.allocate_slots(seq, 1)
            seq.num_scheduled_tokens = 1
        return seqs

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence wherever it is."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
