"""Scheduler: token budget, decodes first, chunked prefill, preemption by recompute."""
from engine.core.block_manager import BlockManager
from engine.core.scheduler import Scheduler
from engine.request.sampling_params import SamplingParams
from engine.request.sequence import Sequence


def run_step(sched: Scheduler, next_token: int = 1) -> list[Sequence]:
    out = sched.schedule()
    for seq in out.scheduled:
        seq.num_computed_tokens += seq.num_scheduled_tokens
        sched.block_manager.register_full_blocks(seq)
        if seq.num_computed_tokens == len(seq):
            seq.append_token(next_token)
    return out.scheduled


def test_chunked_prefill_respects_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    seq = Sequence("a", list(range(25)), SamplingParams())
    sched.add(seq)
    sizes = []
    for _ in range(3):
        run_step(sched)
        sizes.append(seq.num_computed_tokens)
    assert sizes == [10, 20, 25]
    assert len(seq) == 26  # sampled once the prompt completed


def test_decodes_go_first_then_prefill_chunks():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a = Sequence("a", list(range(3)), SamplingParams())
    sched.add(a)
    run_step(sched)  # a prefilled, now decoding
    b = Sequence("b", list(range(20)), SamplingParams())
    sched.add(b)
    out = sched.schedule()
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert a.num_scheduled_tokens == 1 and b.num_scheduled_tokens == 7


def test_preemption_when_blocks_run_out_and_everything_completes():
    bm = BlockManager(6, 4)  # 24 token slots
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [Sequence(str(i), list(range(i * 10, i * 10 + 7)), SamplingParams()) for i in range(3)]
    for s in seqs:
        sched.add(s)
    finished = set()
    for _ in range(200):
        for s in run_step(sched):
            if s.num_output_tokens >= 6 and s.num_computed_tokens == len(s) - 1:
                sched.finish(s)
                finished.add(s.request_id)
        if not sched.has_unfinished():
            break
    assert finished == {"0", "1", "2"}
    assert sched.num_preemptions > 0
    assert bm.num_free_blocks == bm.num_blocks


def test_max_num_seqs_limits_admission():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(4):
        sched.add(Sequence(str(i), [1, 2, 3], SamplingParams()))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_can_admit_needs_a_waiting_sequence_and_a_free_seat():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_num_batched_tokens=64)
    assert not sched.can_admit()
    sched.add(Sequence("a", list(range(5)), SamplingParams()))
    assert sched.can_admit()
    run_step(sched)
    sched.add(Sequence("b", list(range(5)), SamplingParams()))
    assert not sched.can_admit()   # a waits, but max_num_seqs are running


def test_decode_continuation_allocates_one_slot_each_or_nothing():
    bm = BlockManager(3, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = Sequence("a", list(range(3)), SamplingParams()), Sequence("b", list(range(7)), SamplingParams())
    sched.add(a)
    sched.add(b)
    run_step(sched)   # a: 3 computed in 1 block, b: 7 in 2 blocks; nothing left free
    assert bm.num_free_blocks == 0
    for seq in (a, b):   # as after an overlapped step: its input computed, its sampled token in flight
        seq.token_ids.pop()
        seq.num_in_flight_tokens = 1
        seq.num_computed_tokens += 1
    assert sched.schedule_decode_continuation([]) is None
    assert sched.schedule_decode_continuation([a, b]) is None   # each needs a new block
    assert [len(s.block_table) for s in (a, b)] == [1, 2]
    sched.finish(b)
    assert sched.schedule_decode_continuation([a]) == [a]
    assert len(a.block_table) == 2 and a.num_scheduled_tokens == 1 and len(a) == 4   # the token in flight counts
